"""Issue 24, item 6: a JIT-build lock left by a kill -9 (torch waits on it forever, silently) never hangs a run.
On CPU nothing is built at all (DeepSpeed's shm_comm op is marked incompatible: training does not use it); a
stale lock is removed and a fresh one named, then removed by a watcher once it turns stale."""
import os
import time

import pytest

from mplug_pretrain.train.distributed import clear_stale_build_locks, watch_build_locks
from tests.helpers import read_log, run_mplug, tiny_pretrain_args


def make_lock(root, op: str, age_minutes: float) -> str:
    folder = root / op
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text("# half-written\n")
    lock = folder / "lock"
    lock.write_text("")
    past = time.time() - 60 * age_minutes
    for path in (folder / "build.ninja", lock, folder):
        os.utime(path, (past, past))
    return str(lock)


def test_a_stale_lock_is_removed_and_a_fresh_one_named(tmp_path, capsys):
    stale = make_lock(tmp_path, "cpu_adam", age_minutes=30)
    fresh = make_lock(tmp_path, "deepspeed_shm_comm", age_minutes=0)
    assert clear_stale_build_locks(str(tmp_path), stale_minutes=5) == [fresh]
    err = capsys.readouterr().err
    assert not os.path.exists(stale) and f"removed the stale build lock {stale}" in err
    assert os.path.exists(fresh) and f"build lock {fresh} present" in err


def test_the_watcher_removes_a_lock_once_it_turns_stale(tmp_path):
    lock = make_lock(tmp_path, "cpu_adam", age_minutes=0)
    thread = watch_build_locks([lock], stale_minutes=1.5 / 60, poll_seconds=0.2)  # stale after 1.5 s
    thread.join(timeout=20)
    assert not thread.is_alive() and not os.path.exists(lock)


@pytest.mark.slow
def test_pretraining_starts_beside_a_fresh_shm_comm_lock_and_builds_nothing(tmp_path, demo_shards):
    extensions = tmp_path / "torch_extensions"
    lock = make_lock(extensions, "deepspeed_shm_comm", age_minutes=0)  # as a kill -9 mid-build leaves it
    # ZeRO-2 with the optimizer offloaded: no DeepSpeed CPU op (cpu_adam) either, the client AdamW steps
    args = tiny_pretrain_args(tmp_path, demo_shards, "lock", steps=2, extra=["distributed.offload_optimizer=true"])
    proc = run_mplug(["pretrain", *args], env={"TORCH_EXTENSIONS_DIR": str(extensions)}, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"build lock {lock} present" in proc.stderr
    assert [r["step"] for r in read_log(tmp_path / "lock")] == [1, 2]
    assert sorted(os.listdir(extensions)) == ["deepspeed_shm_comm"]  # no op folder was made: nothing compiled
    assert sorted(os.listdir(extensions / "deepspeed_shm_comm")) == ["build.ninja", "lock"]
