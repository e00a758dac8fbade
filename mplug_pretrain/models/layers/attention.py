"""Multi-head attention on ``F.scaled_dot_product_attention`` and the attention biases built once per stack.

Masks travel as additive float biases broadcastable to [B, heads, T_query, T_key]: 0 where a key may be
attended, the dtype's most negative finite value where not. A finite value (not -inf) keeps a row whose
keys are all masked finite (uniform attention) instead of NaN.

Biases are built in the dtype attention runs in (``attention_dtype``: autocast's bf16 under autocast, else
fp32), once per stack. An fp32 bias next to bf16 queries would make SDPA's memory-efficient kernel
ineligible on a GPU (mask and query dtypes must match), cost a cast per layer, and the cast turns
fp32's most negative value into -inf in bf16 (all-masked rows then give NaN).

Casts: under autocast every ``nn.Linear`` casts its fp32 input to bf16 itself, so Q, K and V of one input would
cast it three times (and cross-attention K, V the image states twice per layer); ``MultiHeadAttention`` casts
each input once (``to_autocast_dtype``) and feeds that to every projection. Without autocast nothing is cast.

Backends: on sm90 SDPA tries cuDNN attention first where the cuDNN runtime is recent enough, then flash,
memory-efficient and math (``sdpa_backends``); ``MPLUG_SDPA_PREFER_CUDNN=0`` puts flash first.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mplug_pretrain.models.layers.dropout import attention_with_dropout


def attention_dtype(device: torch.device) -> torch.dtype:
    """The dtype of queries and keys here: autocast's when autocast is on for ``device``, else fp32."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype when autocast is on for its device and ``x`` is fp32 (else ``x`` itself): the
    one cast every projection of ``x`` then shares."""
    if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]
FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
               SDPBackend.MATH]
CUDNN_SEQ_LEN_FIX = 91500  # cuDNN runtimes up to 9.15.0 mis-handle sequence lengths not divisible by 128


@functools.cache
def _cudnn_attention_preferred(device_index: int) -> bool:
    version = torch.backends.cudnn.version() or 0
    return torch.cuda.get_device_capability(device_index)[0] == 9 and version > CUDNN_SEQ_LEN_FIX


def sdpa_backends(device: torch.device) -> list[SDPBackend] | None:
    """SDPA's backend priority on ``device`` (None: torch's own order, always off CUDA).

    On sm90 with a cuDNN runtime newer than 9.15.0, ``CUDNN_FIRST``: cuDNN attention where it is eligible (it
    accepts our masks; in training not BERT's attention dropout 0.1, which is not a multiple of 1/16), then
    flash. Older cuDNN runtimes keep torch's order (flash first): their cuDNN attention is wrong for sequence
    lengths not divisible by 128 (257 image tokens). ``MPLUG_SDPA_PREFER_CUDNN=0``: ``FLASH_FIRST`` on CUDA."""
    if device.type != "cuda":
        return None
    if os.environ.get("MPLUG_SDPA_PREFER_CUDNN", "1") == "0":
        return FLASH_FIRST
    index = device.index if device.index is not None else torch.cuda.current_device()
    return CUDNN_FIRST if _cudnn_attention_preferred(index) else None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
           dropout_p: float = 0.0, is_causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` under ``sdpa_backends``' priority: q [B, H, T, d], k, v [B, H, S, d]
    -> [B, H, T, d]. Inside a compiled block the compiler picks the kernel: no device queries there (a cuDNN
    version read is a graph break under ``fullgraph``)."""
    if torch.compiler.is_compiling():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal)
    backends = sdpa_backends(q.device)
    with sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=is_causal)


def bias_from_keep(keep: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Bool ``keep`` (True = attend) -> additive bias of the same shape (dtype None: ``attention_dtype``)."""
    dtype = attention_dtype(keep.device) if dtype is None else dtype
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)


def cast_bias(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bias`` in ``dtype`` with masked entries at ``dtype``'s most negative finite value (not -inf)."""
    if bias.dtype == dtype:
        return bias
    return bias.to(dtype).nan_to_num(neginf=torch.finfo(dtype).min)


def key_padding_bias(mask: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Padding mask [B, S] (1 = real token) -> bias [B, 1, 1, S]; None when there is no mask.

    An all-ones mask still gives a (zero) bias: asking whether it is all ones would read a device value on the
    host (a sync, once per attention stack), which costs more than SDPA's masked kernel.
    """
    if mask is None:
        return None
    return bias_from_keep(mask[:, None, None, :].bool(), dtype)


def causal_keep(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """[T, S] bool: query i (the last ``queries`` of ``keys`` positions) may attend key j <= its position.
    ``queries == keys``: SDPA's ``is_causal`` mask (top-left aligned, the same when T == S)."""
    query_pos = torch.arange(keys - queries, keys, device=device)
    return torch.arange(keys, device=device)[None, :] <= query_pos[:, None]


def concat_key_bias(biases: list[torch.Tensor | None], lengths: list[int]) -> torch.Tensor | None:
    """Concatenate per-segment key biases [B, 1, 1, S_i] (None = unmasked segment of length S_i)."""
    if all(b is None for b in biases):
        return None
    ref = next(b for b in biases if b is not None)
    parts = [b if b is not None else ref.new_zeros(ref.shape[0], 1, 1, n) for b, n in zip(biases, lengths)]
    return torch.cat(parts, dim=-1)


class MultiHeadAttention(nn.Module):
    """BERT-layout multi-head attention: separate ``query``/``key``/``value`` projections and ``out``.

    forward(x [B, T, D], source [B, S, D] | None, bias | None, kv=(k, v) | None, is_causal) -> [B, T, D]
    softmax(Q K^T / sqrt(d_head) + bias) V, computed by SDPA (flash / memory-efficient / cuDNN kernels).
    ``source`` None means self-attention; ``kv`` passes precomputed (e.g. cached) keys and values [B, H, S, d].
    ``is_causal``: query i attends keys j <= i (self-attention, no bias), the mask flash and cuDNN accept.
    Shared sources: a source (or kv) of B / g rows serves g consecutive rows of ``x`` each (the beams or
    samples of one image), with a bias of B / g rows; its keys and values are computed once, not g times.
    """

    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if width % heads:
            raise ValueError(f"attention width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, -1).transpose(1, 2)  # [B, H, T, d_head]

    def keys_values(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """source [B, S, D] -> keys, values [B, H, S, d_head], from one cast of ``source``."""
        source = to_autocast_dtype(source)
        return self.split_heads(self.key(source)), self.split_heads(self.value(source))

    def forward(self, x: torch.Tensor, source: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, is_causal: bool = False) -> torch.Tensor:
        x = to_autocast_dtype(x)
        q = self.split_heads(self.query(x))
        k, v = kv if kv is not None else self.keys_values(x if source is None else source)
        if bias is not None and bias.dtype != q.dtype:  # e.g. a bf16 model called without autocast
            bias = cast_bias(bias, q.dtype)
        b, heads, t, d = q.shape
        groups = k.shape[0]
        if groups != b:  # g = b / groups query rows per source row: [b, H, t, d] -> [groups, H, g * t, d]
            q = q.view(groups, b // groups, heads, t, d).transpose(1, 2).reshape(groups, heads, -1, d)
        if is_causal and (bias is not None or groups != b):
            raise ValueError("is_causal self-attention takes no bias and no shared source")
        if self.training and self.dropout > 0 and q.device.type == "cpu":
            if is_causal:  # the causal mask as a bias: CPU dropout runs outside SDPA
                bias = bias_from_keep(causal_keep(t, k.shape[2], q.device), q.dtype)
            out = attention_with_dropout(q, k, v, bias, self.dropout)  # SDPA would fall back to its math path
        else:
            out = attend(q, k, v, bias, self.dropout if self.training else 0.0, is_causal)
        if groups != b:
            out = out.view(groups, heads, b // groups, t, d).transpose(1, 2).reshape(b, heads, t, d)
        return self.out(out.transpose(1, 2).reshape(b, t, -1))
