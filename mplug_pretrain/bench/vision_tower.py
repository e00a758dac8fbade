"""`mplug bench vision-tower`: our CLIP ViT (models/towers/vision.py, the default ``model.vision.backbone: clip_vit``)
against timm's ViT of the same size (``timm:vit_base_patch16_224``: width 768, 12 layers, 12 heads, patch 16,
224 px), both random-initialised, fp32, CPU, training mode, batch 8: forward + backward of the sum of the tokens,
and forward alone under no_grad. The timm tower runs through our ExternalTower (what ``timm:<name>`` builds), so
the row is what a user switching backbones gets. seconds = median over interleaved rounds (each round times
every case once, so load changes hit both alike). Rows: mode, ours_seconds, timm_seconds, ratio (timm / ours;
> 1 means ours is faster), batch, image_size, rounds.
"""
from __future__ import annotations

import statistics
import time

import torch

from mplug_pretrain.bench.common import write_bench
from mplug_pretrain.models.towers.external import ExternalTower
from mplug_pretrain.models.towers.vision import VisionTransformer


def run(out: str, quick: bool = False) -> dict:
    """quick=True (test suite): width 64, 2 layers, 32 px, one round."""
    torch.manual_seed(0)
    size, patch, width, layers, heads = (32, 16, 64, 2, 2) if quick else (224, 16, 768, 12, 12)
    batch, rounds, warmup = (2, 1, 0) if quick else (8, 3, 1)
    ours = VisionTransformer(size, patch, width, layers, heads).train()
    timm_tower = ExternalTower("timm:vit_base_patch16_224", size,
                               {"embed_dim": width, "depth": layers, "num_heads": heads, "patch_size": patch}).train()
    params = (sum(p.numel() for p in ours.parameters()), sum(p.numel() for p in timm_tower.parameters()))
    image = torch.randn(batch, 3, size, size)

    def train_step(tower):
        def step() -> None:
            tower(image).sum().backward()
        return step

    def forward(tower):
        def step() -> None:
            with torch.no_grad():
                tower(image)
        return step

    cases = {("train fwd+bwd", "ours"): train_step(ours), ("train fwd+bwd", "timm"): train_step(timm_tower),
             ("forward (no grad)", "ours"): forward(ours), ("forward (no grad)", "timm"): forward(timm_tower)}
    times: dict = {key: [] for key in cases}
    for round_index in range(warmup + rounds):
        for key, fn in cases.items():
            start = time.perf_counter()
            fn()
            if round_index >= warmup:
                times[key].append(time.perf_counter() - start)
    rows = []
    for mode in ("train fwd+bwd", "forward (no grad)"):
        ours_s, timm_s = statistics.median(times[(mode, "ours")]), statistics.median(times[(mode, "timm")])
        rows.append({"mode": mode, "ours_seconds": ours_s, "timm_seconds": timm_s, "ratio": timm_s / ours_s,
                     "batch": batch, "image_size": size, "width": width, "layers": layers, "rounds": rounds})
    import timm
    return write_bench("vision_tower", rows, out, quick=quick, timm=timm.__version__, ours_parameters=params[0],
                       timm_parameters=params[1], timm_model="vit_base_patch16_224", precision="fp32")
