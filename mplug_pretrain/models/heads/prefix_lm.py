"""Prefix language modeling (PrefixLM, mPLUG §3.3 after PALM): continue a caption from an image and its prefix.

Input layout (right padded, as the tokenizer writes it): [CLS] c_1 .. c_n [SEP] [PAD]...
Split rule (``split_prefix``): k, the number of caption tokens in the prefix, is drawn uniformly from
    {lo, ..., hi},  hi = n - 1 (at least one caption token is left to predict),  lo = min(prefix_min_tokens, hi)
(n = 0 gives k = 0). ``split`` fixes k instead (captioning: k = prompt tokens).
    prefix  = [CLS] c_1 .. c_k [SEP]           -> text encoder + fusion with the image -> decoder memory
    target  = [CLS] c_{k+1} .. c_n [SEP]       -> decoder input; [CLS] is the BOS
Loss: L = -(1/N) sum log p(target_{t+1} | target_<=t, memory) over the N real target tokens after BOS
(token-level mean over the batch; optional label smoothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID, PAD_ID
from mplug_pretrain.utils.host_syncs import check_on_device


@dataclass
class PrefixSplit:
    prefix_ids: torch.Tensor  # [B, Tp]
    prefix_mask: torch.Tensor  # [B, Tp]
    target_ids: torch.Tensor  # [B, Tt], target_ids[:, 0] = BOS
    target_mask: torch.Tensor  # [B, Tt]
    prefix_tokens: torch.Tensor  # [B] k


def caption_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """n per row (tokens between [CLS] and [SEP]); checks the layout the split relies on (on the device: no
    host sync; ValueError on the CPU)."""
    lengths = attention_mask.long().sum(1)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    check_on_device((attention_mask.bool() == (positions[None] < lengths[:, None])).all(),
                    "attention_mask must be right-padded (ones then zeros)")
    check_on_device((lengths >= 2).all() & (input_ids[:, 0] == BOS_ID).all(),
                    f"every text must start with [CLS] ({BOS_ID}) and end with [SEP] ({EOS_ID})")
    last = input_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])
    check_on_device((last == EOS_ID).all(), f"every text must end with [SEP] ({EOS_ID}) before its padding")
    return lengths - 2


def split_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix_min_tokens: int = 1,
                 split: torch.Tensor | None = None, generator: torch.Generator | None = None) -> PrefixSplit:
    """Split each caption into a prefix and a target (module docstring). The drawn split pads prefix and
    target to the text's length T (their longest rows are at most T long): sizing them to the longest row
    would read the drawn lengths on the host, a sync per step. A fixed ``split`` sizes them exactly."""
    n = caption_lengths(input_ids, attention_mask)
    t = input_ids.shape[1]
    if split is None:
        hi = (n - 1).clamp(min=0)
        lo = torch.minimum(torch.full_like(hi, prefix_min_tokens), hi)
        u = torch.rand(n.shape, generator=generator, device=n.device)
        k = torch.minimum(lo + (u * (hi - lo + 1).float()).long(), hi)  # min() guards u*(m) rounding up to m
    else:
        k = split.to(n.device).long().expand_as(n)
        check_on_device(((k <= n) & (k >= 0)).all(),
                        "prefix split longer than a caption (a caption shorter than its prompt?)")
    pos = torch.arange(t, device=input_ids.device)[None]
    prefix_len = t if split is None else min(t, int(split) + 2)  # a fixed split is a host value
    prefix_pos = pos[:, :prefix_len]
    prefix_ids = torch.where(prefix_pos <= k[:, None], input_ids[:, :prefix_len], PAD_ID)
    prefix_ids = torch.where(prefix_pos == k[:, None] + 1, EOS_ID, prefix_ids)
    prefix_mask = (prefix_pos <= k[:, None] + 1).long()
    target_real = n - k + 2  # BOS + n - k caption tokens + SEP
    target_len = t if split is None else max(2, t - int(split))
    target_pos = pos[:, :target_len]
    source = (k[:, None] + target_pos).clamp(max=t - 1)
    target_ids = input_ids.gather(1, source)
    target_ids[:, 0] = BOS_ID
    target_mask = (target_pos < target_real[:, None]).long()
    target_ids = target_ids.masked_fill(target_mask == 0, PAD_ID)
    return PrefixSplit(prefix_ids, prefix_mask, target_ids, target_mask, k)


def prefix_lm_loss(logits: torch.Tensor, target_ids: torch.Tensor, target_mask: torch.Tensor,
                   label_smoothing: float = 0.0) -> torch.Tensor:
    """logits [B, Tt, V] from the decoder run on target_ids -> token-mean next-token cross-entropy."""
    labels = target_ids[:, 1:].masked_fill(target_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100, label_smoothing=label_smoothing)
