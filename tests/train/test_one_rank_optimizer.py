"""The optimizer step on one CPU rank (train/engine.py): AdamW is torch's fused kernel there, equal to torch's default
per-parameter loop up to float rounding, and a one-rank ZeRO-0 engine does no gradient
all-reduce (DeepSpeed would flatten, all-reduce and copy back every gradient for nothing); a real engine on the
demo shards, in a subprocess, with DeepSpeed's reduction counted."""
import json
import subprocess
import sys

import pytest
import torch

from mplug_pretrain.config import load_config
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.train.engine import build_optimizer
from tests.helpers import REPO_ROOT


def test_cpu_adamw_is_fused_and_equals_the_default_loop():
    cfg = load_config(None, ["model.preset=tiny", "optim.weight_decay=0.05"], check_paths=False)
    torch.manual_seed(0)
    model = build_model("tiny")
    fused = build_optimizer(model, cfg, "cpu")
    assert all(group["fused"] for group in fused.param_groups)
    params = [p for group in fused.param_groups for p in group["params"]]
    copies = {p: p.detach().clone().requires_grad_() for p in params}
    initial = [p.detach().clone() for p in params]
    default = torch.optim.AdamW([{**{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")},
                                  "params": [copies[p] for p in g["params"]]} for g in fused.param_groups],
                                foreach=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
            copies[p].grad = p.grad.clone()
        fused.step()
        default.step()
    assert all(not torch.equal(p, before) for p, before in zip(params, initial))  # every parameter stepped
    for p in params:  # the same update up to float rounding (the kernel orders a few operations differently)
        torch.testing.assert_close(p, copies[p], rtol=1e-6, atol=1e-7)


WORKER = r'''
import json
from mplug_pretrain.bench.host_syncs import _demo_run
from mplug_pretrain.train.loop import _micro_step

cfg, engine, run, loader = _demo_run(["distributed.precision=fp32"])
reductions = []
reduce = engine.buffered_allreduce_fallback
def counted(*args, **kwargs):
    reductions.append(1)
    return reduce(*args, **kwargs)
engine.buffered_allreduce_fallback = counted
counts = {"stage": engine.zero_optimization_stage(), "fused": [g["fused"] for g in engine.optimizer.param_groups]}
for _ in range(2):
    _micro_step(run, next(loader))
counts["one_rank"] = len(reductions)
engine.enable_backward_allreduce = True  # DeepSpeed's default: the control
_micro_step(run, next(loader))
counts["default"] = len(reductions) - counts["one_rank"]
print("RESULT " + json.dumps(counts))
'''


@pytest.mark.slow  # one DeepSpeed engine in a subprocess
def test_one_rank_zero0_engine_reduces_no_gradient():
    proc = subprocess.run([sys.executable, "-c", WORKER], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert result["stage"] == 0 and all(result["fused"]), result
    assert result["one_rank"] == 0, result
    assert result["default"] == 1, result  # the counter sees DeepSpeed's reduction when it runs
