"""tests/warm_mplug.py, the warm server behind ``run_mplug``: a command forked from it reports what a fresh
``python -m mplug_pretrain`` reports (exit code, stdout, stderr), with the call's environment and working
directory, and a command that runs past its timeout is killed and raises as ``subprocess.run`` does."""
import os
import subprocess

import pytest

from tests import helpers


def test_a_forked_command_reports_what_a_fresh_interpreter_reports(tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  warmup_steps: soon\n")
    args = ["pretrain", "--config", str(bad)]
    warm = helpers.run_mplug(args)
    monkeypatch.setenv("MPLUG_TEST_COLD", "1")
    cold = helpers.run_mplug(args)
    assert warm.returncode == cold.returncode == 2
    assert warm.stderr == cold.stderr and "optim.warmup_steps" in warm.stderr
    assert warm.stdout == cold.stdout


def test_the_call_environment_and_working_directory_reach_the_command():
    # data.train_shards names a path relative to the working directory (REPO_ROOT): the demo shards exist there
    missing = helpers.run_mplug(["pretrain", "--config", os.path.join(helpers.REPO_ROOT, "configs", "pretrain_tiny.yaml"),
                                 "--nproc", "2"], env={"RANK": "0", "WORLD_SIZE": "1"})
    assert missing.returncode == 2 and "the environment already has RANK=0 WORLD_SIZE=1" in missing.stderr


def test_a_command_past_its_timeout_is_killed_and_raises(tmp_path):
    args = helpers.tiny_pretrain_args(tmp_path, {"pretrain_train": os.path.join(
        helpers.REPO_ROOT, "data_shards", "pretrain", "train-{000000..000003}.tar")}, "slow", steps=10_000, vocab="bert")
    with pytest.raises(subprocess.TimeoutExpired):
        helpers.run_mplug(["pretrain", *args], timeout=3)
    again = helpers.run_mplug(["pretrain", "--config", "/nonexistent.yaml"])  # the server still serves
    assert again.returncode == 2
