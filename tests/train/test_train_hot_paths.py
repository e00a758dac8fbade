"""Step hot paths on CPU: the multi-tensor momentum update equals the per-parameter formula bit for bit;
the fused AdamW kernel is chosen wherever torch has one for the optimizer's tensors (GPU and CPU), not when offloaded."""
import copy

import pytest
import torch

from mplug_pretrain.config import load_config
from mplug_pretrain.models.layers.momentum import ema_update_
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import get_preset_config
from mplug_pretrain.train.engine import build_optimizer, use_fused_adamw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_momentum_update_equals_per_parameter_formula_exactly(dtype):
    torch.manual_seed(0)
    model = MPLUG(get_preset_config("tiny")).to(dtype)
    for p in model.parameters():  # online weights move away from their momentum copies
        p.data.add_(torch.randn_like(p) * 0.1)
    reference = copy.deepcopy(model)
    m = model.config.heads.momentum
    with torch.no_grad():
        for online, momentum in reference.momentum_pairs():
            for p, p_m in zip(online.parameters(), momentum.parameters()):
                p_m.mul_(m).add_(p.to(p_m.dtype), alpha=1.0 - m)  # the former per-parameter update
    model.momentum_update()
    ours, theirs = model.state_dict(), reference.state_dict()
    changed = 0
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
        changed += "_m." in key
    assert changed > 0


def test_ema_update_mixed_dtypes_and_length_check():
    target = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2)]
    source = [torch.full((3,), 3.0), torch.full((2,), 2.0, dtype=torch.float64)]
    ema_update_(target, source, 0.75)
    assert torch.equal(target[0], torch.full((3,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(target[1], torch.full((2,), 0.5))
    with pytest.raises(ValueError, match="2 momentum parameters for 1 online"):
        ema_update_(target, source[:1], 0.5)


def test_fused_adamw_where_torch_has_the_kernel():
    assert use_fused_adamw("cuda", offload_optimizer=False) and use_fused_adamw("cpu", offload_optimizer=False)
    assert not use_fused_adamw("cuda", offload_optimizer=True)  # ZeRO-Offload: DeepSpeed steps its own way
    assert not use_fused_adamw("xpu", offload_optimizer=False)
    cfg = load_config(None, ["model.preset=tiny"], check_paths=False)
    model = MPLUG(get_preset_config("tiny"))
    assert build_optimizer(model, cfg, "cpu").defaults["fused"] is True  # (equal to the loop: test_one_rank_optimizer)
    assert build_optimizer(model, cfg, "cuda").defaults["fused"] is True
    if torch.cuda.is_available():  # on a GPU the fused optimizer also steps
        model.cuda()
        opt = build_optimizer(model, cfg, "cuda")
        sum(p.sum() for p in model.parameters() if p.requires_grad).backward()
        opt.step()


def test_training_batches_are_pinned_only_where_they_go_to_a_gpu(monkeypatch):
    from mplug_pretrain.train.checkpoint import TrainerState
    from mplug_pretrain.train.loop import training_loader_spec
    cfg = load_config(None, ["model.preset=tiny"], check_paths=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not training_loader_spec(cfg, 0, 1, TrainerState()).pin_memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training_loader_spec(cfg, 0, 1, TrainerState()).pin_memory


def test_base_pretraining_config_runs_without_gradient_checkpointing():
    import os

    from tests.helpers import REPO_ROOT
    cfg = load_config(os.path.join(REPO_ROOT, "configs", "pretrain_base.yaml"), check_paths=False)
    assert cfg.model.grad_checkpointing is False and cfg.model.preset == "base"
