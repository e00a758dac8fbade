"""DeepSpeed engine around our model: client AdamW with two LR groups (no DeepSpeed optimizer or
scheduler, so no JIT optimizer build and no hijacked LR), ZeRO 0-3, bf16, gradient checkpointing.

Precision (docs/precision.md): a bf16 run uses DeepSpeed's ``torch_autocast`` mode, not its ``bf16``
mode. The parameters stay fp32 (they are the optimizer's masters, or an exact copy of them), the engine runs
the forward under bf16 autocast (never an autocast of ours around it), and the model keeps fp32 islands
(LayerNorm, losses, ITC/ITM logits). So the momentum encoders, the queues and the exported model are fp32
without a shadow copy: DeepSpeed's ``bf16`` mode would cast the momentum towers to bf16, where the EMA
increment (1 - m) * (θ - θm) at m = 0.995 rounds away.

Momentum update ``θm ← m·θm + (1−m)·θ`` (models/layers/momentum.py, one multi-tensor update per module pair):
stages 0-2 keep parameters replicated and update them in place; under ZeRO-3 online and momentum towers are
partitioned alike (same shapes, same partitioning), so each rank updates its own shards (``ds_tensor``), and
the full copies of persistent (small, never released) parameters: no gather, no broadcast.

AdamW is torch's fused kernel on a GPU and on the CPU (one pass over each parameter's four tensors: on the CPU
4-5x faster than torch's default per-parameter loop for the tiny preset's 184 tensors, and equal to it up to float
rounding); not with the optimizer offloaded, which DeepSpeed runs its own way. On one rank at ZeRO-0 the engine
skips DeepSpeed's gradient all-reduce (a flatten, a one-rank all-reduce and a copy back of every gradient, each
step, for nothing).
"""
from __future__ import annotations

import torch

from mplug_pretrain.config import Config, deepspeed_config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.utils.precision import use_fp32_layer_norms

# The DeepSpeed versions this engine was tested with (torch_autocast mode, parameters kept fp32, the ZeRO-3
# shard layout the momentum update relies on); setup.cfg pins the same range (tests/utils/test_precision.py).
DEEPSPEED_VERSIONS = ">=0.19.8,<0.20"


def check_deepspeed_version(version: str | None = None) -> None:
    """Raise ConfigError when the installed DeepSpeed (or ``version``) is outside ``DEEPSPEED_VERSIONS``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    if Version(version).release and Version(Version(version).base_version) in SpecifierSet(DEEPSPEED_VERSIONS):
        return
    raise ConfigError(f"DeepSpeed {version} is installed; this version of mplug_pretrain was tested with "
                      f"deepspeed{DEEPSPEED_VERSIONS} (its bf16 policy depends on DeepSpeed's torch_autocast "
                      f"mode and ZeRO-3 partitioning): pip install 'deepspeed{DEEPSPEED_VERSIONS}'")


def use_fused_adamw(train_device_type: str, offload_optimizer: bool) -> bool:
    """The fused AdamW kernel where torch has one for the optimizer's tensors (CUDA and CPU), unless offloaded."""
    return train_device_type in ("cuda", "cpu") and not offload_optimizer


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


def build_engine(model, cfg: Config, world_size: int, partitioned_checkpoint: bool = False):
    """-> (engine, optimizer, DeepSpeed config). ZeRO 1-2 on one rank run as ZeRO-0 (config.engine_zero_stage;
    ``partitioned_checkpoint``: the checkpoint to resume has the partitioned layout, keep the stage)."""
    import deepspeed
    check_deepspeed_version()
    model.set_grad_checkpointing(cfg.model.grad_checkpointing)
    optimizer = build_optimizer(model, cfg, train_device_type())
    ds_config = deepspeed_config(cfg, world_size, partitioned_checkpoint)
    if ds_config.get("torch_autocast", {}).get("enabled"):
        use_fp32_layer_norms(model)  # CPU autocast would run LayerNorm in bf16; CUDA autocast runs it in fp32
    model.defer_enqueue = True  # queues take a batch only once its loss is finite on every rank (models/step_hooks.py)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    _check_fp32_parameters(engine.module)
    if ds_config["zero_optimization"]["stage"] == 0:
        if engine.dp_world_size == 1:
            engine.enable_backward_allreduce = False  # the gradients are already this one rank's (= the average)
        if cfg.optim.grad_clip > 0:
            use_foreach_clipping(engine)
    if cfg.run.compile:
        from mplug_pretrain.train.block_compile import compile_blocks
        compile_blocks(engine.module, cfg.run.compile_backend)  # in place: names and DeepSpeed's hooks unchanged
    return engine, optimizer, ds_config


def use_foreach_clipping(engine) -> None:
    """ZeRO-0 gradient clipping by torch's multi-tensor ``clip_grad_norm_`` (a few foreach kernels), in place of
    DeepSpeed's loop (a norm and a multiply per parameter, and an all-reduce of the norm even on one rank); the
    norm it returns becomes the engine's global gradient norm (DeepSpeed's ZeRO-0 path keeps none to log).
    ZeRO-0 gradients are already averaged over ranks, so each rank's norm is the global one."""
    def clip() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        engine._global_grad_norm = torch.nn.utils.clip_grad_norm_(params, engine.gradient_clipping(), foreach=True)
    engine.clip_fp32_gradients = clip  # DeepSpeed's _take_model_step calls it at stage 0 (fp32 parameters)


def engine_precision(engine) -> str:
    """"bf16" when the engine runs its forward under bf16 autocast (a bf16 run), else "fp32"."""
    if engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16:
        return "bf16"
    return "fp32"


def _check_fp32_parameters(module) -> None:
    wrong = [name for name, p in module.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if wrong:
        raise RuntimeError(f"DeepSpeed cast parameters to {module.get_parameter(wrong[0]).dtype} ({wrong[0]}, ...): "
                           "the precision policy keeps them fp32 (bf16 runs use torch_autocast, config.deepspeed_config)")


def after_optimizer_step(engine, zero_stage: int) -> None:
    """What follows every optimizer step (models/step_hooks.py): the momentum EMA and the clamps (the ITC
    temperature), both on fp32 masters."""
    momentum_update(engine, zero_stage)
    clamp_parameters(engine, zero_stage)


@torch.no_grad()
def clamp_parameters(engine, zero_stage: int) -> None:
    """Clamp each of the model's ``clamped_parameters()`` (the ITC temperature) to its range on the optimizer's
    fp32 master (as open_clip clamps its logit scale after the step) and on the module's copy. Under ZeRO 1-2 the
    master is a fragment of one rank's flat partition, under ZeRO-3 this rank's shard: each rank clamps what it
    holds, no communication."""
    for param, lo, hi in engine.module.clamped_parameters():
        if zero_stage == 3:
            from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param
            local = safe_get_local_fp32_param(param)
            if local is not None:
                safe_set_local_fp32_param(param, local.clamp(lo, hi))
            param.ds_tensor.clamp_(lo, hi)
            if param.data.numel() == param.ds_numel:  # persistent: its full copy is the one the forward uses
                param.data.clamp_(lo, hi)
            continue
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:  # ZeRO 1-2: this rank holds the master's fp32 fragment
            mapping.get_hp_fragment().clamp_(lo, hi)
        param.data.clamp_(lo, hi)


@torch.no_grad()
def momentum_update(engine, zero_stage: int) -> None:
    """EMA of every momentum pair after an optimizer step (module docstring: in place, or shard by shard)."""
    module = engine.module
    pairs = module.momentum_pairs()
    if not pairs:
        return
    from mplug_pretrain.models.layers.momentum import ema_update_
    m = module.momentum
    if zero_stage < 3:
        for online, momentum in pairs:  # one multi-tensor update per module pair
            ema_update_(list(momentum.parameters()), list(online.parameters()), m)
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for online, momentum in pairs:
        shards, shards_m, full, full_m = [], [], [], []
        for (name, p), p_m in zip(online.named_parameters(), momentum.parameters()):
            if p.ds_numel != p_m.ds_numel or p.ds_tensor.numel() != p_m.ds_tensor.numel():
                raise RuntimeError(f"momentum_update: {name} and its momentum copy are partitioned differently")
            shards.append(p.ds_tensor)
            shards_m.append(p_m.ds_tensor)
            if p_m.ds_status == ZeroParamStatus.AVAILABLE:  # a persistent parameter: its full copy stays in use
                if p.ds_status != ZeroParamStatus.AVAILABLE:
                    raise RuntimeError(f"momentum_update: the momentum copy of {name} is persistent, {name} is not")
                full.append(p.data)
                full_m.append(p_m.data)
        ema_update_(shards_m, shards, m)
        ema_update_(full_m, full, m)


def save_final_model(engine, out_dir: str, zero_stage: int, rank: int, cfg: Config | None = None) -> None:
    """The fp32 model folder (save_pretrained) from the live engine: its parameters are the fp32 optimizer
    masters (stages 1-3: an exact fp32 copy of them); under ZeRO-3 the partitions are gathered first (all at
    once: fine for models that fit one host's memory). With the run's ``cfg`` the folder also gets its
    tokenizer, preprocessing.json and VQA decoding settings."""
    module = engine.module
    if zero_stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if rank == 0:
                _check_fp32_parameters(module)
                module.save_pretrained(out_dir)
    elif rank == 0:
        _check_fp32_parameters(module)
        module.save_pretrained(out_dir)
    if rank == 0 and cfg is not None:
        from mplug_pretrain.train.export import complete_model_folder
        complete_model_folder(out_dir, cfg)
