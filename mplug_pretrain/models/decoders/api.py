"""The contract every text decoder head (bert | expansion | acf) implements, so that training
losses, beam search, sampling and SCST are written once.

    decoder(input_ids, attention_mask, memory, memory_mask, past=None, use_cache=False, vocab=None)
        input_ids      LongTensor [B, T_new]  tokens to run (all tokens, or only new ones with `past`)
        attention_mask LongTensor [B, T_past + T_new]  1 = real token, 0 = padding (causality is
                       applied inside the decoder; padding masks keys only)
        memory         FloatTensor [B, M, D]  concat(image_states, text_states) from fusion
        memory_mask    LongTensor [B, M]      1 = attend
        past           opaque cache returned by an earlier call, or None
        vocab          slice of the vocabulary, or None for all of it: the logits of just these tokens
                       (grounding's coordinate tokens), without the [.., V] product the rest would cost
        -> DecoderOutput(logits [B, T_new, V] (or the slice's length), past)

    decoder.reorder_cache(past, index LongTensor [B']) -> past   # select/repeat batch rows (beams)

Token conventions (BERT WordPiece, bert-base-uncased vocab): sequences start with [CLS] (id 101,
used as BOS) and end with [SEP] (id 102, EOS); [PAD] is 0; [MASK] is 103.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BOS_ID = 101
EOS_ID = 102
PAD_ID = 0
MASK_ID = 103


@dataclass
class DecoderOutput:
    logits: torch.Tensor  # [B, T_new, V]
    past: Any | None = None
