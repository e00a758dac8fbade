"""The forked ranks of ``mplug pretrain --nproc N`` without a GPU (utils/fork_launch.py), with small rank functions in
a launcher process of their own: what each rank sees, the exit code when ranks fail, the stop of the other ranks,
and the signals passed on. On real 2-rank runs: the pretraining tests (tests/tasks/pretrain, tests/train), which
fork by default; tests/tasks/pretrain/test_pretrain_engine.py resumes a forked run under torchrun bit for bit."""
import json
import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO_ROOT

LAUNCHER = r'''
import json, os, signal, sys, time
from mplug_pretrain.utils import fork_launch

out, scenario = sys.argv[1], sys.argv[2]
fork_launch.STOP_GRACE_SECONDS = 1.0


def note(**fields):
    with open(os.path.join(out, f"rank{os.environ['RANK']}.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


def rank_main():
    rank = int(os.environ["RANK"])
    note(env={k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                         "MASTER_PORT", "MPLUG_LAUNCHER_PID")},
         pid=os.getpid(), ppid=os.getppid(), sid=os.getsid(0))
    if scenario == "env":
        return 0
    if scenario == "raise" and rank == 1:
        raise RuntimeError("rank 1 broke")
    if scenario == "code" and rank == 1:
        time.sleep(0.5)
        return 3
    signal.signal(signal.SIGTERM, lambda s, f: note(signal="SIGTERM"))  # noted, and the rank goes on
    signal.signal(signal.SIGUSR1, lambda s, f: note(signal="SIGUSR1"))
    open(os.path.join(out, f"ready{rank}"), "w").close()
    while True:
        time.sleep(0.05)


code = fork_launch.fork_ranks(2, rank_main, master_port=12345)
with open(os.path.join(out, "launcher.json"), "w") as f:
    json.dump({"code": code, "pid": os.getpid(), "sid": os.getsid(0)}, f)
'''


def start(tmp_path, scenario: str) -> subprocess.Popen:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    return subprocess.Popen([sys.executable, str(script), str(tmp_path), scenario], cwd=REPO_ROOT,
                            env=dict(os.environ, PYTHONPATH=REPO_ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def notes(tmp_path, rank: int) -> list[dict]:
    with open(tmp_path / f"rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


def finish(proc: subprocess.Popen, tmp_path) -> tuple[dict, str]:
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with open(tmp_path / "launcher.json") as f:
        return json.load(f), err


def test_each_rank_sees_its_rank_the_world_and_a_session_of_its_own(tmp_path):
    launcher, _ = finish(start(tmp_path, "env"), tmp_path)
    assert launcher["code"] == 0
    seen = [notes(tmp_path, rank)[0] for rank in (0, 1)]
    for rank, rank_seen in enumerate(seen):
        assert rank_seen["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12345",
                                    "MPLUG_LAUNCHER_PID": str(launcher["pid"])}
        assert rank_seen["ppid"] == launcher["pid"]
        assert rank_seen["sid"] == rank_seen["pid"] != launcher["sid"]  # a signal to the launcher's group misses it


def test_a_failing_rank_stops_the_other_and_gives_the_launcher_its_code(tmp_path):
    # rank 0 notes SIGTERM and goes on: the launcher kills it after STOP_GRACE_SECONDS (1 s here)
    start_time = time.time()
    launcher, err = finish(start(tmp_path, "code"), tmp_path)
    assert launcher["code"] == 3  # rank 1's own code, not 128 + 9 of the killed rank 0
    assert {"signal": "SIGTERM"} in notes(tmp_path, 0)
    assert "[launcher] rank(s) 0, 1 failed (exit 3)" in err
    assert time.time() - start_time < 60


def test_an_exception_in_a_rank_prints_its_traceback_and_exits_1(tmp_path):
    launcher, err = finish(start(tmp_path, "raise"), tmp_path)
    assert launcher["code"] == 1
    assert "Traceback" in err and "RuntimeError: rank 1 broke" in err


def test_stop_signals_pass_to_the_ranks_and_a_second_ctrl_c_kills_them(tmp_path):
    proc = start(tmp_path, "wait")
    deadline = time.time() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and time.time() < deadline:
        time.sleep(0.05)

    def wait_for(note: dict) -> None:
        end = time.time() + 30
        while time.time() < end and not all(note in notes(tmp_path, r) for r in (0, 1)):
            time.sleep(0.05)

    os.kill(proc.pid, signal.SIGUSR1)  # as Slurm's --signal=B:USR1 would
    wait_for({"signal": "SIGUSR1"})
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C: SIGTERM to the ranks (they save and stop)
    wait_for({"signal": "SIGTERM"})
    os.kill(proc.pid, signal.SIGINT)  # a second Ctrl-C: SIGKILL
    launcher, err = finish(proc, tmp_path)
    for rank in (0, 1):
        assert [n["signal"] for n in notes(tmp_path, rank)[1:]] == ["SIGUSR1", "SIGTERM"]
    assert launcher["code"] == 128 + signal.SIGKILL
    assert "[launcher] SIGUSR1 passed to the 2 rank(s): each saves" in err
    assert "[launcher] SIGINT passed to the 2 rank(s) as SIGTERM" in err
    assert "[launcher] SIGINT passed to the 2 rank(s) as SIGKILL: killed" in err
