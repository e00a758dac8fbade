"""Helpers shared by the integration tests: run the real CLI, in this process (``call_mplug``) or, where the
command starts processes of its own or initialises torch.distributed, in a process of its own (``run_mplug``)."""
import contextlib
import io
import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_WARM = None


def run_mplug(args, env=None, timeout=900) -> subprocess.CompletedProcess:
    """``python -m mplug_pretrain ARGS`` in a process of its own, forked from a warm server that imported torch,
    DeepSpeed and the model once (tests/warm_mplug.py); ``MPLUG_TEST_COLD=1``: a fresh interpreter each time."""
    global _WARM
    full_env = dict(os.environ)
    full_env.update(env or {})
    if os.environ.get("MPLUG_TEST_COLD") == "1" or not sys.platform.startswith("linux"):
        return subprocess.run([sys.executable, "-m", "mplug_pretrain", *args], check=False, cwd=REPO_ROOT,
                              env=full_env, capture_output=True, text=True, timeout=timeout)
    if _WARM is None:
        from tests.warm_mplug import WarmMplug
        _WARM = WarmMplug()
    return _WARM.run(list(args), full_env, timeout)


def call_mplug(args) -> subprocess.CompletedProcess:
    """``mplug ARGS`` through ``cli.main`` in this process: return code, stdout and stderr as ``run_mplug`` gives
    them (argparse's exits become return codes)."""
    from mplug_pretrain.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["mplug", *args], code, out.getvalue(), err.getvalue())


def read_log(run_dir):
    path = os.path.join(str(run_dir), "log.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def demo_vocab(shards: dict) -> list[str]:
    """The overrides that train on the demo shards' own 268-word vocabulary (``shards['tokenizer']``) instead of
    BERT's 30,522 words, whose embedding gradients, zero-fills and vocabulary products were about half of a tiny
    step (one rank, batch 4: 0.31-0.41 s vs 0.16-0.24)."""
    from mplug_pretrain.demo.vocab import vocab_size
    return [f"data.tokenizer={shards['tokenizer']}", f"model.text.vocab_size={vocab_size(shards['tokenizer'])}"]


def tiny_pretrain_args(tmp_path, shards, name, steps, extra=(), vocab: str = "demo"):
    """A tiny-preset pretraining run of ``steps`` steps on the demo shards, deterministic. ``vocab="demo"``: the
    demo's vocabulary (``demo_vocab``: what most tests check does not depend on it); ``vocab="bert"``: the
    preset's BERT vocabulary (BERT initialisation, token ids written in the test, shards with other words)."""
    if vocab not in ("demo", "bert"):
        raise ValueError(f"vocab: demo | bert, got {vocab!r}")
    words = demo_vocab(shards) if vocab == "demo" else []
    return ["--config", os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml"), *words,
            f"data.train_shards={shards['pretrain_train']}", "data.batch_size=4", "data.num_workers=1",
            f"optim.max_steps={steps}", "optim.warmup_steps=1", f"run.output_dir={tmp_path}",
            f"run.name={name}", "run.tensorboard=false", "run.plot_losses=false", "model.heads.queue_size=32", *extra]


def forked_ranks(nproc: int, *target: str, preload: tuple[str, ...] = ()) -> list[str]:
    """The command running ``target`` (a script and its arguments, or ``-c CODE ...``) on ``nproc`` ranks forked
    from one process that imported torch, DeepSpeed and the model first, or just ``preload`` (tests/fork_ranks.py):
    torchrun's environment, without a fresh interpreter per rank."""
    first = ["--preload", ",".join(preload)] if preload else []
    return [sys.executable, os.path.join(REPO_ROOT, "tests", "fork_ranks.py"), str(nproc), *first, *target]


def two_rank_worker(code: str, setting: str, out, test_file: str, timeout: int = 600) -> dict:
    """Run ``code`` on 2 forked ranks (gloo) with argv [setting, out, the test's folder] (the worker imports the
    test module from there) and return the JSON that rank 0 wrote to ``out``."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    cmd = forked_ranks(2, "-c", code, setting, str(out), os.path.dirname(os.path.abspath(test_file)),
                       preload=("torch.distributed", "mplug_pretrain.models.presets"))  # no DeepSpeed in these
    proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)
