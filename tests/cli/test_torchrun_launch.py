"""The `--nproc N` launcher (cli/torchrun_launch.py): which processes get the forwarded stop signals, and the exit
code when ranks fail (the rank's own code, as a single process gives it). The signals themselves on a real
2-rank run: tests/train/test_train_faults.py::test_a_stop_signal_to_the_nproc_launcher_saves_and_exits_0_without_a_traceback."""
import os
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mplug_pretrain.cli.torchrun_launch import exit_code, rank_pids


def _failure(rank: int, code: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
    failure.timestamp = timestamp
    return failure


def test_exit_code_is_the_first_failing_ranks_own():
    assert exit_code({0: _failure(0, -15, 2), 1: _failure(1, 3, 1)}) == 3  # rank 0 only stopped by torchrun
    assert exit_code({0: _failure(0, 2, 5), 1: _failure(1, 3, 1)}) == 3
    assert exit_code({1: _failure(1, -9, 1)}) == 128 + 9


def test_rank_pids_are_this_processes_children_running_mplug(tmp_path):
    script = tmp_path / "mplug_pretrain_rank.py"  # a child whose command line names mplug_pretrain
    script.write_text("import time\ntime.sleep(30)\n")
    rank = subprocess.Popen([sys.executable, str(script)])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = rank_pids(os.getpid())
        assert rank.pid in found and other.pid not in found
    finally:
        for proc in (rank, other):
            proc.kill()
            proc.wait()


def test_nproc_under_an_inherited_world_of_another_size_is_refused(tmp_path, monkeypatch, demo_shards):
    """A shell (or a process that trained in-process) with RANK=0 WORLD_SIZE=1 exported: `--nproc 2` used to run as
    that one-rank world, silently. Now one line says so, before anything starts."""
    from tests.helpers import call_mplug, tiny_pretrain_args
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    proc = call_mplug(["pretrain", "--nproc", "2", *tiny_pretrain_args(tmp_path, demo_shards, "inherited", 1)])
    assert proc.returncode == 2
    assert "--nproc 2: the environment already has RANK=0 WORLD_SIZE=1" in proc.stderr
    assert "Unset RANK WORLD_SIZE LOCAL_RANK" in proc.stderr
    assert not (tmp_path / "inherited").exists()
