"""Importing mplug_pretrain before torch makes OpenMP wait passively (bench/cpu_threads.py measures why) unless
the user chose a policy; imported after torch it changes nothing (OpenMP has read its settings by then)."""
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

PROBE = "import os, sys; {first}import mplug_pretrain; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"


@pytest.mark.parametrize(("given", "torch_first", "expected"), [
    (None, False, "PASSIVE"), ("ACTIVE", False, "ACTIVE"), (None, True, "unset")])
def test_passive_wait_is_the_default_only_where_it_can_act(given, torch_first, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = PROBE.format(first="import torch; " if torch_first else "")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == expected
