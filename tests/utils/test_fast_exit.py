"""utils/fast_exit.exit_now ends a process with the given code after what an orderly exit does first: a
non-daemon thread finishes, atexit handlers run, buffered stdout and stderr reach the pipe; and it skips the
interpreter's teardown (an object's finaliser that only teardown would run does not run)."""
import subprocess
import sys

from tests.helpers import REPO_ROOT

CODE = r"""
import atexit, sys, threading, time
from mplug_pretrain.utils.fast_exit import exit_now
out = sys.argv[1]

def late_write():
    time.sleep(0.5)
    open(out + "/thread", "w").write("done")

class Finalised:
    def __del__(self, _open=open, _path=out + "/teardown"):  # (teardown clears builtins: bound here)
        _open(_path, "w").write("ran")

keep = Finalised()  # a module global: only the interpreter's teardown would finalise it
threading.Thread(target=late_write).start()
atexit.register(lambda: open(out + "/atexit", "w").write("ran"))
sys.stdout.write("x" * 100000)  # buffered, no newline
sys.stderr.write("tail of stderr")
exit_now(int(sys.argv[2]))
"""


def test_exit_now_keeps_threads_atexit_and_output_and_gives_the_code(tmp_path):
    for code in (0, 3):
        proc = subprocess.run([sys.executable, "-c", CODE, str(tmp_path), str(code)], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == code, proc.stderr[-2000:]
        assert proc.stdout == "x" * 100000 and proc.stderr.endswith("tail of stderr")
        assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"
        assert not (tmp_path / "teardown").exists()  # no teardown: what exit_now skips (sys.exit writes it)


def test_python_m_mplug_pretrain_exits_with_the_commands_code():
    proc = subprocess.run([sys.executable, "-m", "mplug_pretrain", "pretrain", "--config", "/nonexistent.yaml"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "mplug:" in proc.stderr and "nonexistent.yaml" in proc.stderr, proc.stderr
