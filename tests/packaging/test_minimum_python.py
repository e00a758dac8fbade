"""The package runs on the oldest Python that setup.cfg's ``python_requires`` admits: vermin reads every module
(annotations evaluated too, as if ``from __future__ import annotations`` were absent) and finds nothing newer.
``typing.Self`` (3.11) in bench/train_step.py once broke ``mplug bench train-step`` on 3.10."""
import configparser
import os
import re
import subprocess
import sys

from tests.helpers import REPO_ROOT

# vermin reads torch's ``tensor.long()`` as Python 2's ``long`` builtin: a false "incompatible" note
NOT_PYTHON_2_LONG = ("--exclude", "long")


def minimum_python() -> str:
    """``python_requires = >=3.10`` -> "3.10"."""
    parser = configparser.ConfigParser()
    parser.read(os.path.join(REPO_ROOT, "setup.cfg"))
    requires = parser["options"]["python_requires"]
    found = re.fullmatch(r"\s*>=\s*(\d+\.\d+)\s*", requires)
    assert found, f"setup.cfg python_requires {requires!r}: expected '>=X.Y'"
    return found.group(1)


def vermin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())",
                           "--no-config-file", f"--target={minimum_python()}-", "--no-tips", "--eval-annotations",
                           "--violations", *NOT_PYTHON_2_LONG, *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_minimum_python_is_read_from_setup_cfg():
    assert re.fullmatch(r"3\.\d+", minimum_python())


def test_vermin_flags_a_feature_newer_than_the_minimum(tmp_path):
    newer = tmp_path / "newer.py"
    newer.write_text("from typing import Self\n")  # 3.11
    result = vermin(str(newer))
    assert result.returncode == 1 and "typing.Self" in result.stdout, result.stdout + result.stderr


def test_the_package_needs_nothing_newer_than_python_requires():
    result = vermin("mplug_pretrain")
    report = result.stdout + result.stderr
    assert result.returncode == 0 and "Target versions not met" not in report, report
    assert "Analyzing" in report  # vermin looked at the files
