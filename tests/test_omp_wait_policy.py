"""Importing mplug_pretrain before torch makes OpenMP spin briefly, then sleep (bench/cpu_threads.py measures
why) unless the user chose a policy; imported after torch it changes nothing (OpenMP has read its settings)."""
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

PROBE = ("import os, sys; {first}import mplug_pretrain; "
         "print(os.environ.get('OMP_WAIT_POLICY', 'unset'), os.environ.get('GOMP_SPINCOUNT', 'unset'))")


@pytest.mark.parametrize(("given", "torch_first", "expected"), [
    (None, False, "PASSIVE 10000"), ("ACTIVE", False, "ACTIVE unset"), (None, True, "unset unset")])
def test_short_spin_then_sleep_is_the_default_only_where_it_can_act(given, torch_first, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = PROBE.format(first="import torch; " if torch_first else "")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == expected
