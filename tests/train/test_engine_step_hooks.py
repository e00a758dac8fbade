"""The engine's after-step work goes through the model's public step hooks (models/step_hooks.py) alone: a module
that is not MPLUG, with one momentum pair and one clamped parameter, trained by a real DeepSpeed engine (ZeRO 0 and
2, fp32, one CPU rank in a subprocess), gets theta_m <- m theta_m + (1 - m) theta and its clamp, computed here
independently from the parameters before and after the optimizer step."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

WORKER = r'''
import json, sys
import torch
from torch import nn
import mplug_pretrain  # noqa: F401
from mplug_pretrain.models.step_hooks import StepHooks
from mplug_pretrain.train.distributed import init_distributed
from mplug_pretrain.train.engine import after_optimizer_step

class Toy(StepHooks, nn.Module):
    momentum = 0.75
    def __init__(self):
        super().__init__()
        self.online = nn.Linear(3, 2)
        self.online_m = nn.Linear(3, 2).requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor([0.5]))  # DeepSpeed broadcasts no 0-dim parameter
    def momentum_pairs(self):
        return [(self.online, self.online_m)]
    def clamped_parameters(self):
        return [(self.scale, 0.6, 2.0)]
    def forward(self, x):
        return (self.online(x).sum() * self.scale) ** 2

stage = int(sys.argv[1])
init_distributed("gloo", 1)
import deepspeed
torch.manual_seed(0)
model = Toy()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5, weight_decay=0.0)
config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": stage}}
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
momentum_before = [p.detach().clone() for p in model.online_m.parameters()]
engine.backward(engine(torch.ones(4, 3)))
engine.step()
online_after = [p.detach().clone() for p in model.online.parameters()]
scale_stepped = float(model.scale)
after_optimizer_step(engine, stage)
expected = [0.75 * b + 0.25 * a for b, a in zip(momentum_before, online_after)]
ema_error = max(float((p - e).abs().max()) for p, e in zip(model.online_m.parameters(), expected))
master = model.scale._hp_mapping.get_hp_fragment() if getattr(model.scale, "_hp_mapping", None) is not None else None
print("RESULT " + json.dumps({"ema_error": ema_error, "scale_stepped": scale_stepped, "scale": float(model.scale),
                              "master": None if master is None else float(master.reshape(-1)[0]),
                              "moved": max(float((a - b).abs().max()) for a, b in zip(online_after, momentum_before))}))
'''


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_updates_and_clamps_through_the_public_hooks(stage, tmp_path):
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29650 + stage), PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([sys.executable, "-c", WORKER, str(stage)], check=False, cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["moved"] > 1e-3  # the online weights moved, so the EMA has something to follow
    assert result["ema_error"] < 1e-6
    assert result["scale_stepped"] < 0.6  # the step pushed it out of range ...
    assert result["scale"] == pytest.approx(0.6)  # ... and the hook's clamp brought it back
    if stage == 2:
        assert result["master"] == pytest.approx(0.6)  # on the fp32 master fragment too
