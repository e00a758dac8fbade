"""Decoding on CPU with prepacked fp32 weights: MKL's packed GEMM (``cblas_sgemm_pack``), packed once per block.

Why: every decoding step multiplies a few rows (images x beams) by every weight of the decoder. At that size
the products stream the weights, and MKL's sgemm spends about a quarter of each product re-packing the
weight matrix it is given. Packed once, the products of a 6-layer base decoder step took 16-17 ms instead of
22-23 ms on a 2-core Xeon (bench/NOTES.md "Packed weights and a short OpenMP spin"); packing them all takes
~75 ms, so it pays only over several decoding calls with unchanged weights: an evaluation pass. The packed
copies hold a second copy of the decoder's linear weights while the block lasts.

    with packed_for_decoding(decoder) as fast:   # no gradient, weights fixed inside the block
        for memory, memory_mask in batches:
            beam_search(fast, memory, memory_mask, ...)

``fast`` is a shallow copy of ``decoder`` sharing every parameter, with each ``nn.Linear`` (and the
vocabulary projection of ``LMPredictionHead``) replaced by a packed one. A packed product packs its weight
for the row count of its first call (a beam search's steps: batch x beams) and falls back to the plain
product for any other row count (the first call's memory keys and values, a smaller last batch). Packed
products equal the plain ones to float rounding (the bench's beam-1 captions and scores came out bit for bit
equal; at beams 3 and 5 the scores moved by <= 2e-6).
The packed copies live only inside the block: on exit they are dropped and ``fast`` computes plain products.
Weights must not change inside the block (nothing can tell: optimizers write through ``.data``).
Where packing does not apply (no MKL, a parameter off the CPU or not fp32, ZeRO-3 partitioned parameters,
a decoder in training mode) the block yields ``decoder`` itself. Under autograd or autocast ``fast``
computes plain products (packed GEMM has no backward and no autocast rule).
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.models.heads.lm_head import LMPredictionHead


def packing_available() -> bool:
    """MKL is built in and exposes the packed-linear operators (private to PyTorch: checked, not assumed)."""
    mkl_ops = torch.ops.mkl
    return (torch.backends.mkl.is_available() and hasattr(mkl_ops, "_mkl_linear")
            and hasattr(mkl_ops, "_mkl_reorder_linear_weight"))


class PackedProduct:
    """y = x W^T + b with W packed for the row count of the first call (see the module docstring)."""

    def __init__(self):
        self.rows: int | None = None
        self.packed: torch.Tensor | None = None
        self.source: torch.Tensor | None = None  # the weight that was packed
        self.active = True

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in], weight [out, in], bias [out] | None -> [..., out]."""
        if (not self.active or torch.is_grad_enabled() or x.dtype != torch.float32
                or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, weight, bias)
        rows = x.numel() // max(x.shape[-1], 1)
        if rows == 0:  # an empty batch: nothing worth packing for
            return F.linear(x, weight, bias)
        if self.packed is None or self.source is not weight:
            self.rows, self.source = rows, weight
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, weight, bias, self.rows)

    def release(self) -> None:
        self.packed, self.source, self.active = None, None, False


class PackedLinear(nn.Module):
    """An ``nn.Linear``'s parameters (shared, not copied) with a packed product."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product = PackedProduct()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


class PackedLMHead(nn.Module):
    """An ``LMPredictionHead`` (its transform packed too) whose vocabulary projection is packed."""

    def __init__(self, head: LMPredictionHead):
        super().__init__()
        self.head = head  # the shallow copy: its transform is already a PackedLinear
        self.product = PackedProduct()

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor | None = None,
                vocab: slice | None = None) -> torch.Tensor:
        if vocab is not None:  # a slice of the vocabulary: the plain product of those rows
            return self.head(hidden, word_embeddings, vocab=vocab)
        return self.product(self.head.features(hidden), self.head.vocab_weight(word_embeddings), self.head.bias)


def _with_packed_products(module: nn.Module, products: list[PackedProduct]) -> nn.Module:
    if type(module) is nn.Linear:
        packed = PackedLinear(module)
        products.append(packed.product)
        return packed
    clone = copy.copy(module)  # shares parameters and buffers; only the child modules are replaced
    clone._modules = {name: None if child is None else _with_packed_products(child, products)
                      for name, child in module._modules.items()}
    if isinstance(module, LMPredictionHead):
        packed_head = PackedLMHead(clone)
        products.append(packed_head.product)
        return packed_head
    return clone


def packing_applies(decoder: nn.Module) -> bool:
    """CPU fp32 parameters, none partitioned by ZeRO-3, the decoder in eval mode, MKL's packed GEMM present."""
    params = list(decoder.parameters())
    return (bool(params) and not decoder.training and packing_available()
            and all(p.device.type == "cpu" and p.dtype == torch.float32 and not hasattr(p, "ds_id")
                    for p in params))


@contextmanager
def packed_for_decoding(decoder: nn.Module) -> Iterator[nn.Module]:
    """Yield ``decoder`` with packed products for the block (or ``decoder`` itself where packing does not apply)."""
    if not packing_applies(decoder):
        yield decoder
        return
    products: list[PackedProduct] = []
    fast = _with_packed_products(decoder, products)
    try:
        yield fast
    finally:
        for product in products:
            product.release()
