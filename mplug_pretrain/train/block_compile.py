"""``run.compile``: torch.compile each transformer block on its own, as torchtitan does.

Blocks: the ViT's ``ResidualAttentionBlock`` and every ``BertLayer`` (text encoder, fusion, decoder, and the
momentum copies). Each is compiled in place (``nn.Module.compile``: state-dict names, DeepSpeed's hooks and
checkpoints are unchanged) with ``fullgraph=True``, so a graph break inside a block is an error, not a silent
fallback, and ``dynamic=False``: one static graph per input shape. What lies between blocks (embeddings, the
MLM masking draw, the losses, the ITC queues) stays eager: it is small, and it holds what dynamo cannot
capture whole (``torch.rand(..., generator=...)``, the queue's collectives).

Static shapes need a bounded set of text lengths: ``pad_text`` pads ``input_ids`` / ``attention_mask``
[B, T] on the right with zeros to the next multiple of ``TEXT_LENGTH_MULTIPLE`` (T <= data.max_text_len = 30
gives lengths 8, 16, 24, 32). Padded keys are masked out, so a loss changes only through the masking and
prefix draws, whose shapes follow T.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.towers.text import BertLayer
from mplug_pretrain.models.towers.vision import ResidualAttentionBlock

BLOCK_TYPES = (ResidualAttentionBlock, BertLayer)
TEXT_LENGTH_MULTIPLE = 8
TEXT_KEYS = ("input_ids", "attention_mask")
# one graph per (block kind, batch rows, length, grad mode): ITM runs fusion on 3B rows, PrefixLM on a prefix,
# the momentum towers without grad; torch's default of 8 graphs per code object is too few for 4 text lengths
RECOMPILE_LIMIT = 64


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) for every block ``compile_blocks`` compiles, in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, BLOCK_TYPES)]


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every transformer block of ``model`` in place (module docstring). -> the number compiled."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError("run.compile: the model has no ViT block or BERT layer to compile")
    import torch._dynamo.config
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for _, block in blocks:
        block.compile(backend=backend, fullgraph=True, dynamic=False)
    return len(blocks)


def pad_text(batch: dict, multiple: int = TEXT_LENGTH_MULTIPLE) -> dict:
    """``batch`` with ``input_ids`` / ``attention_mask`` [B, T] right-padded with 0 to a multiple of ``multiple``;
    other keys, and a batch without text, unchanged."""
    if not all(key in batch for key in TEXT_KEYS):
        return batch
    length = batch["input_ids"].shape[1]
    missing = -length % multiple
    if missing == 0:
        return batch
    return {**batch, **{key: F.pad(batch[key], (0, missing), value=0) for key in TEXT_KEYS}}


def is_compiled(module: nn.Module) -> bool:
    """True when ``module`` was compiled in place (``nn.Module.compile``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


