"""The bf16 policy's cost against DeepSpeed's own ``bf16`` mode, one process per mode (CPU, tiny preset):

    python -m mplug_pretrain.bench.precision_modes ds_bf16  # DeepSpeed casts every parameter to bf16
    python -m mplug_pretrain.bench.precision_modes torch_autocast  # ours: fp32 parameters, bf16 autocast

Prints the median time of steps 3-8 (forward, backward, optimizer step, momentum update; ZeRO-2, 1 rank,
1 thread, batch 8) and the bytes of the module's parameters. Run the two alternately: the machine is shared.
"""
from __future__ import annotations

import os
import statistics
import sys
import time


def measure(mode: str, steps: int = 8) -> dict:
    import deepspeed
    import torch

    from mplug_pretrain.bench.common import pretrain_batch
    from mplug_pretrain.config import deepspeed_config, load_config
    from mplug_pretrain.tasks.pretrain.train import build_model
    from mplug_pretrain.train.distributed import init_distributed
    from mplug_pretrain.train.engine import build_optimizer
    from mplug_pretrain.utils.precision import use_fp32_layer_norms
    torch.set_num_threads(1)
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29641"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    init_distributed("gloo", 5)
    cfg = load_config(None, ["model.preset=tiny", "distributed.zero_stage=2", "distributed.precision=bf16",
                             "data.batch_size=8", "model.heads.queue_size=32"], check_paths=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    ds = deepspeed_config(cfg, 1)
    batch = pretrain_batch("tiny", 8)
    if mode == "ds_bf16":
        ds["bf16"] = {"enabled": True}
        ds.pop("torch_autocast")
        batch = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                 for k, v in batch.items()}
    elif mode == "torch_autocast":
        use_fp32_layer_norms(model)  # as train/engine.build_engine does
    else:
        raise ValueError(f"mode: ds_bf16 or torch_autocast, got {mode!r}")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg), config=ds)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.backward(engine(batch)["loss"])
        engine.step()
        engine.module.momentum_update()
        times.append(time.perf_counter() - start)
    return {"mode": mode, "median_step_s": statistics.median(times[2:]),
            "param_mb": sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 2**20}


if __name__ == "__main__":
    print(measure(sys.argv[1]))
