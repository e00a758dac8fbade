"""Masked language modeling (MLM) on the fused text states (BERT recipe, mPLUG §3.3: 15%).

``mask_tokens``: each real, non-special token (not [PAD] [UNK] [CLS] [SEP] [MASK]) is selected with
probability p (0.15); a selected token becomes [MASK] with prob. 0.8, a uniformly random vocabulary id
with prob. 0.1, and stays unchanged with prob. 0.1. labels = original id at selected positions, -100 elsewhere.
Loss: L_mlm = mean over selected positions of -log softmax(LMHead(fused_text))[label], the head tied to the
text encoder's word embeddings. Logits at every position; only the selected ones count (no host sync to find them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID, MASK_ID, PAD_ID
from mplug_pretrain.models.heads.lm_head import LMPredictionHead

UNK_ID = 100
SPECIAL_IDS = (PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID)
IGNORE_INDEX = -100


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int, probability: float = 0.15,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (masked_ids [B, T], labels [B, T]); see the module docstring."""
    device = input_ids.device
    special = torch.isin(input_ids, torch.tensor(SPECIAL_IDS, device=device))
    maskable = attention_mask.bool() & ~special
    selected = (torch.rand(input_ids.shape, generator=generator, device=device) < probability) & maskable
    labels = input_ids.masked_fill(~selected, IGNORE_INDEX)
    action = torch.rand(input_ids.shape, generator=generator, device=device)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device=device)
    masked = torch.where(selected & (action < 0.8), torch.full_like(input_ids, MASK_ID), input_ids)
    masked = torch.where(selected & (action >= 0.8) & (action < 0.9), random_ids, masked)
    return masked, labels


def mlm_loss(head: LMPredictionHead, fused_text: torch.Tensor, labels: torch.Tensor,
             word_embeddings: torch.Tensor) -> torch.Tensor:
    """fused_text [B, T, D], labels [B, T] -> mean cross-entropy over selected positions (0 when none is).

    The head runs on every position and unselected ones are ignored: selecting the ~15% first (boolean-mask
    indexing) would need their count on the host, a sync per step that costs more than the extra logits.
    Logits are upcast and the loss is fp32."""
    logits = head(fused_text, word_embeddings)
    summed = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    return summed / (labels != IGNORE_INDEX).sum().clamp(min=1)
