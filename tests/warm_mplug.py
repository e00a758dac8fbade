"""A warm ``python -m mplug_pretrain`` for the tests (``tests/helpers.run_mplug``): one process per pytest worker
imports what the commands import (torch, torch._dynamo, DeepSpeed and its Muon optimizer, the tokenizer, the model:
``mplug_pretrain.utils.fork_launch.PRELOAD``) once, then forks a child per command. The child takes the call's
environment, working directory and ``sys.argv``, writes its stdout / stderr to the call's files and runs the real
CLI (``cli.app.main``), ending as ``python -m mplug_pretrain`` does (``utils.fast_exit.exit_now``). A fresh
interpreter spends about 10 CPU-s on those imports before the command starts; commands that launch ranks
(``--nproc N``) fork them in turn. Tests of what a fresh process does (signals, kill -9, orphans) start one.

Protocol, one JSON line each way: ``{"args", "env", "cwd", "stdout", "stderr"}`` in; ``{"pid"}`` when the child
runs, then ``{"code"}`` (its exit code, -N if killed by signal N) when it ended.

    python tests/warm_mplug.py
"""
import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_ENV = dict(os.environ)  # the server's own environment: the session's, before any test changes it


def _child(request: dict) -> None:
    from mplug_pretrain.utils.fork_launch import run_then_exit

    def command() -> int:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import mplug_pretrain
        from mplug_pretrain.cli.app import main
        sys.argv = [os.path.join(os.path.dirname(mplug_pretrain.__file__), "__main__.py"), *request["args"]]
        return main(request["args"])
    run_then_exit(command)


def serve() -> None:
    from mplug_pretrain.utils.fork_launch import prepare_fork
    reason = prepare_fork()
    if reason is not None:
        raise SystemExit(f"warm_mplug: cannot fork commands here: {reason}")
    import importlib

    import mplug_pretrain.cli.app  # noqa: F401 -- every command's parser
    from mplug_pretrain.cli.registry import REGISTRY
    for command, _, module, _ in REGISTRY:
        if command == "finetune":  # the fine-tuning runs the tests make, as well
            importlib.import_module(module)
    if len(os.listdir("/proc/self/task")) > 1:
        raise SystemExit("warm_mplug: a thread runs after the imports: forking would not be safe")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


class WarmMplug:
    """The client side: one server per pytest worker, started at the first call and restarted if it died."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._pending = b""

    def run(self, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        """``python -m mplug_pretrain ARGS`` with ``env``, in REPO_ROOT, as ``subprocess.run`` reports it."""
        if self._server is None or self._server.poll() is not None:
            self._start()
        command = [sys.executable, "-m", "mplug_pretrain", *args]
        with tempfile.TemporaryDirectory(prefix="warm_mplug") as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            request = {"args": [str(a) for a in args], "env": env, "cwd": REPO_ROOT, "stdout": out, "stderr": err}
            self._server.stdin.write((json.dumps(request) + "\n").encode())
            self._server.stdin.flush()
            pid = self._read(120)["pid"]
            try:
                code = self._read(timeout)["code"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._read(120)
                raise subprocess.TimeoutExpired(command, timeout, _text(out), _text(err)) from None
            return subprocess.CompletedProcess(command, code, _text(out), _text(err))

    def _start(self) -> None:
        env = dict(BASE_ENV, PYTHONPATH=REPO_ROOT)
        self._server = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=REPO_ROOT, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._pending = b""
        atexit.register(self._stop, self._server)

    @staticmethod
    def _stop(server: subprocess.Popen) -> None:
        """End the server's loop and reap it (so its CPU time counts in the caller's, as a child's does)."""
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self._server.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"tests/warm_mplug.py ended (exit {self._server.wait()})")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)


def _text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


if __name__ == "__main__":
    serve()
