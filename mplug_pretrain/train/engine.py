"""DeepSpeed engine around our model: client AdamW with two LR groups (no DeepSpeed optimizer or
scheduler, so no JIT optimizer build and no hijacked LR), ZeRO 0-3, bf16, gradient checkpointing.

Momentum encoders under ZeRO-3: every parameter is partitioned, so ``θm ← m·θm + (1−m)·θ`` is
applied module pair by module pair (online ViT + momentum ViT, ...) inside one
``GatheredParameters(modifier_rank=0)`` each, which broadcasts rank 0's result back into the
partitions: one gather per module, not per parameter. Stages 0-2 keep parameters replicated and update
in place. Both use one multi-tensor (``torch._foreach_*``) update per module pair (models/momentum.py).

AdamW is the fused CUDA kernel when the parameters train on a GPU (not with the optimizer offloaded
to the CPU); elsewhere torch's default implementation, so CPU runs keep their numerics.
"""
from __future__ import annotations

import torch

from mplug_pretrain.config import Config, deepspeed_config, resolve_precision
from mplug_pretrain.utils import process_group
from mplug_pretrain.utils.precision import autocast_context


def use_fused_adamw(train_device_type: str, offload_optimizer: bool) -> bool:
    """The fused AdamW kernel only where the optimizer's tensors live on a GPU."""
    return train_device_type == "cuda" and not offload_optimizer


def train_device_type() -> str:
    """Where DeepSpeed will put the model: its accelerator's device type ("cuda" or "cpu")."""
    from deepspeed.accelerator import get_accelerator
    name = get_accelerator().device_name()
    return "cuda" if name == "cuda" and torch.cuda.is_available() else name


def build_optimizer(model, cfg: Config, device_type: str = "cpu") -> torch.optim.Optimizer:
    o = cfg.optim
    groups = model.param_groups(weight_decay=o.weight_decay, lr_vision=o.lr_vision, lr_rest=o.lr_rest)
    groups = [g for g in groups if len(g["params"]) > 0]
    for g in groups:
        g["peak_lr"] = g["lr"]
    extra = {"fused": True} if use_fused_adamw(device_type, cfg.distributed.offload_optimizer) else {}
    return torch.optim.AdamW(groups, lr=o.lr_rest, betas=tuple(o.betas), eps=o.eps, **extra)


def build_engine(model, cfg: Config, world_size: int):
    import deepspeed
    model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    optimizer = build_optimizer(model, cfg, train_device_type())
    ds_config = deepspeed_config(cfg, world_size)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if cfg.run.compile:
        engine.compile()  # torch.compile of the wrapped module (DeepSpeed keeps hooks and state dict names)
    return engine, optimizer, ds_config


def train_autocast(cfg: Config):
    """The precision context (utils/precision.py) of a training forward pass: bf16 autocast where the run is
    bf16 (DeepSpeed casts the weights; autocast keeps fp32-sensitive ops in fp32), on this rank's device."""
    return autocast_context(resolve_precision(cfg), process_group.device())


@torch.no_grad()
def momentum_update(engine, zero_stage: int) -> None:
    module = engine.module
    pairs = module._momentum_pairs()
    if not pairs:
        return
    if zero_stage < 3:
        module.momentum_update()
        return
    import deepspeed

    from mplug_pretrain.models.momentum import ema_update_
    m = module.config.heads.momentum
    for online, momentum in pairs:
        params, params_m = list(online.parameters()), list(momentum.parameters())
        with deepspeed.zero.GatheredParameters(params + params_m, modifier_rank=0):  # one gather per module
            if process_group.rank() == 0:
                ema_update_(params_m, params, m)


def save_final_model(engine, out_dir: str, zero_stage: int, rank: int, cfg: Config | None = None) -> None:
    """Full-precision model folder (save_pretrained) from the live engine; under ZeRO-3 the
    partitions are gathered first (all at once: fine for models that fit one host's memory).
    With the run's ``cfg`` the folder also gets its tokenizer, preprocessing.json and VQA decoding settings."""
    module = engine.module
    if zero_stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if rank == 0:
                module.save_pretrained(out_dir)
    elif rank == 0:
        module.save_pretrained(out_dir)
    if rank == 0 and cfg is not None:
        from mplug_pretrain.train.export import complete_model_folder
        complete_model_folder(out_dir, cfg)
