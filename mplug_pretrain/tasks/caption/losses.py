"""Batch losses of caption fine-tuning, from one loader batch to the loss DeepSpeed steps on.

  visual states V: encode_image(image) | ViT under no_grad + projection/refiner (freeze_vision) |
      projection/refiner(cached features)
  xe    memory = fuse(V, "[CLS] a picture of [SEP]"); the decoder reads "[CLS] c_1..c_n" and predicts
        "c_1..c_n [SEP]": token-mean cross-entropy (optional label smoothing): MPLUG.caption_loss_from_states
  scst  one row per distinct image; k samples from the decoder over that memory; CIDEr-D reward against the
        image's training references with the leave-one-out baseline; dropout off (tasks/caption/scst.py)
Padding rows (is_pad) take no part; a batch of padding only gives a zero loss (weight 0 on row 0), so every
rank still runs the same forward/backward.
"""
from __future__ import annotations

import torch
from torch import nn

from mplug_pretrain.models.towers.vision import states_from_vit_tokens
from mplug_pretrain.tasks.caption.scst import CiderDReward, policy_mode, scst_loss


def real_rows(batch: dict) -> list[int]:
    """Indices of the non-padding rows."""
    return [i for i, pad in enumerate(batch["is_pad"].tolist()) if not pad]


def visual_states(module: nn.Module, batch: dict, rows: list[int], freeze_vision: bool) -> torch.Tensor:
    """Visual states [len(rows), 1+M, D] from cached features, a frozen ViT or the full image encoder."""
    if "features" in batch:
        return states_from_vit_tokens(module.image_encoder, batch["features"][rows])
    if freeze_vision:
        with torch.no_grad():
            tokens = module.image_encoder.vit(batch["image"][rows])
        return states_from_vit_tokens(module.image_encoder, tokens)
    return module.encode_image(batch["image"][rows])


def _rows_or_zero(batch: dict) -> tuple[list[int], float]:
    """The real rows with weight 1, or (a batch of padding only) row 0 with weight 0 so every rank steps alike."""
    rows = real_rows(batch)
    return (rows, 1.0) if rows else ([0], 0.0)


def xe_batch_loss(module: nn.Module, batch: dict, freeze_vision: bool, prompt_length: int,
                  label_smoothing: float) -> dict:
    """Cross-entropy of a loader batch (image [B, 3, H, W] or features [B, 1+M, D_vit]; input_ids,
    attention_mask [B, T] = "[CLS] prompt caption [SEP]"; is_pad [B]) -> {"loss": scalar}."""
    rows, weight = _rows_or_zero(batch)
    states = visual_states(module, batch, rows, freeze_vision)
    loss = module.caption_loss_from_states(states, batch["input_ids"][rows], batch["attention_mask"][rows],
                                           prompt_length, label_smoothing)
    return {"loss": loss * weight}


def scst_batch_loss(module: nn.Module, batch: dict, freeze_vision: bool, prompt: torch.Tensor,
                    reward: CiderDReward, tokenizer, k: int, max_length: int, one_pass: bool = False) -> dict:
    """SCST on the distinct images of a loader batch (as ``xe_batch_loss`` plus image_id [B]; ``prompt``
    [1, P] = "[CLS] prompt [SEP]") -> {"loss": scalar, "loss_reward": mean CIDEr-D of the k samples}.
    one_pass: gradient through the sampler (``scst_loss``)."""
    rows, weight = _rows_or_zero(batch)
    first: dict[int, int] = {}
    for i in rows:  # SCST is image-wise: one row per distinct image of the batch
        first.setdefault(int(batch["image_id"][i]), i)
    rows = list(first.values())
    with policy_mode(module):  # dropout off: the sampler and the log-prob recomputation are one network
        states = visual_states(module, batch, rows, freeze_vision)
        ids = prompt.to(states.device).expand(len(rows), -1)
        memory, memory_mask = module.memory_from_states(states, None, ids, torch.ones_like(ids))
        out = scst_loss(module.decoder, memory, memory_mask, list(first), reward, tokenizer, k=k,
                        max_length=max_length, one_pass=one_pass)
    return {"loss": out["loss"] * weight, "loss_reward": out["loss_reward"]}
