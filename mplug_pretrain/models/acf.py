"""Adaptive clustering attention primitives (ACF, Wang et al., "Adaptively Clustering Neighbor
Elements for Image-Text Generation").

1-D clustering matrix over a sequence s_1..s_N (the current layer's input):
    P(s_k | s_i..s_{k-1}) = sigmoid(FC([s_k, mean(s_i..s_{k-1})]))          Eq. 3, FC: Linear(2d, 1)
    C_ij = prod_{k=i+1..j} P(s_k | s_i..s_{k-1}),  C_ii = 1,  C_ji = C_ij    Eq. 2, 4
With FC linear, FC([a, b]) = w_a.a + w_b.b + c, so the span means come from prefix sums of the
scalar w_b.s and log C from a cumulative sum of log-sigmoids: O(N d + N^2), no loop over positions.
2-D (independence assumption, Eq. 7): for tokens p = (row x, col i), q = (row y, col j)
    C_pq = C^h[row min(x, y)]_ij * C^v[col min(i, j)]_xy       (top-most row, left-most column)
optionally computed on an average-pooled grid and replicated back (Down-Up sampling).
Stacking across layers (Eq. 5): C~(m) = (1 - C(m)) C~(m-1) + C(m), C~(1) = C(1), so C~ only grows.
Clustered attention (Eq. 1): A' = softmax(Q K^T / sqrt(d_k) [+ mask]) * C~, shared by all heads,
not renormalised (the Tree-Transformer / APN lineage the paper builds on), then A' V.
Clustering math runs in fp32 even under autocast.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ClusterState(NamedTuple):
    """Causal incremental state of a 1-D clustering matrix after T positions.

    prefix [B, T + 1]: prefix sums of w_b . s (prefix[k] = sum_{m<k});
    last_column [B, T]: log C[i, T - 1] for every i < T (the next column grows from it, Eq. 4).
    """
    prefix: Tensor
    last_column: Tensor


class ClusterEstimator1D(nn.Module):
    """The 1-D clustering matrix of Eq. 2-4 for one layer.

    forward(x [B, N, d]) -> C [B, N, N] (symmetric, unit diagonal, values in [0, 1]).
    causal_rows(x_new [B, T_new, d], state) -> (rows [B, T_new, T] with rows[q, i] = C[T_past + q, i] for
    i <= T_past + q and 0 beyond, new state); chunks fed with the state equal the full matrix.
    """

    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.fc = nn.Linear(2 * width, 1)  # FC([s_k, mean(s_i..s_{k-1})])

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(w_a . s_k, w_b . s_k): [B, T] each, in fp32 (fp64 for fp64 input)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            ab = x.to(dtype) @ self.fc.weight.to(dtype).view(2, self.width).t()
        return ab[..., 0], ab[..., 1]

    def _log_columns(self, a_new: Tensor, prefix: Tensor, base: Tensor) -> Tensor:
        """log C[i, j] for all i < T and the last T_new positions j: [B, T, T_new], valid where i <= j.

        a_new [B, T_new] (w_a . s_j of the new positions), prefix [B, T + 1], base [B, T] (log C[i, T_past - 1]
        for i < T_past, 0 for the new positions).
        """
        t_total, t_new = prefix.shape[1] - 1, a_new.shape[1]
        start = t_total - t_new
        i = torch.arange(t_total, device=prefix.device)[:, None]
        k = torch.arange(start, t_total, device=prefix.device)[None, :]
        span_mean = (prefix[:, None, start:t_total] - prefix[:, :t_total, None]) / (k - i).clamp(min=1)
        log_merge = F.logsigmoid(a_new[:, None, :] + span_mean + self.fc.bias.to(a_new.dtype))  # log P(s_k|s_i..)
        log_merge = log_merge.masked_fill(k <= i, 0.0)
        return base[:, :, None] + log_merge.cumsum(-1)

    def forward(self, x: Tensor) -> Tensor:
        a, p = self._project(x)
        prefix = F.pad(p.cumsum(-1), (1, 0))
        upper = self._log_columns(a, prefix, torch.zeros_like(a)).exp()  # [i, j] valid for j >= i
        n = x.shape[1]
        idx = torch.arange(n, device=x.device)
        return torch.where(idx[None, :] >= idx[:, None], upper, upper.transpose(-1, -2))

    def causal_rows(self, x_new: Tensor, state: ClusterState | None = None) -> tuple[Tensor, ClusterState]:
        a, p = self._project(x_new)
        t_new = a.shape[1]
        if state is None:
            prefix, base = F.pad(p.cumsum(-1), (1, 0)), torch.zeros_like(a)
        else:
            prefix = torch.cat([state.prefix, state.prefix[:, -1:] + p.cumsum(-1)], 1)
            base = torch.cat([state.last_column, torch.zeros_like(a)], 1)
        log_c = self._log_columns(a, prefix, base)  # [B, T, T_new]
        t_total = log_c.shape[1]
        i = torch.arange(t_total, device=x_new.device)[None, :]
        j = torch.arange(t_total - t_new, t_total, device=x_new.device)[:, None]
        rows = log_c.transpose(-1, -2).exp().masked_fill(i > j, 0.0)
        return rows, ClusterState(prefix, log_c[:, :, -1])


def clustering_matrix_2d(grid: Tensor, horizontal: ClusterEstimator1D, vertical: ClusterEstimator1D) -> Tensor:
    """Eq. 7 with the top-most-row / left-most-column rule. grid [B, H, W, d] -> C [B, H*W, H*W] (row-major)."""
    b, h, w, d = grid.shape
    c_h = horizontal(grid.reshape(b * h, w, d)).view(b, h, w, w)  # per row x: columns i, j
    c_v = vertical(grid.transpose(1, 2).reshape(b * w, h, d)).view(b, w, h, h)  # per column i: rows x, y
    rows, cols = torch.arange(h, device=grid.device), torch.arange(w, device=grid.device)
    top_row = torch.minimum(rows[:, None], rows[None, :])  # [H, H]: min(x, y)
    left_col = torch.minimum(cols[:, None], cols[None, :])  # [W, W]: min(i, j)
    horizontal_part = c_h[:, top_row].permute(0, 1, 3, 2, 4)  # [B, x, y, i, j] -> [B, x, i, y, j]
    vertical_part = c_v[:, left_col].permute(0, 3, 1, 4, 2)  # [B, i, j, x, y] -> [B, x, i, y, j]
    return (horizontal_part * vertical_part).reshape(b, h * w, h * w)


class ClusterEstimator2D(nn.Module):
    """2-D clustering matrix with separate horizontal and vertical FCs.

    grid [B, H, W, d] -> C [B, H*W, H*W]. down_up_rate r > 1: C is computed on the r x r average-pooled
    grid and replicated back, C_pq = C_bar[coarse(p), coarse(q)] (the paper's Down-Up sampling).
    """

    def __init__(self, width: int, down_up_rate: int = 1):
        super().__init__()
        if down_up_rate < 1:
            raise ValueError(f"down_up_rate: expected >= 1, got {down_up_rate}")
        self.rate = down_up_rate
        self.horizontal = ClusterEstimator1D(width)
        self.vertical = ClusterEstimator1D(width)

    def forward(self, grid: Tensor) -> Tensor:
        if self.rate == 1:
            return clustering_matrix_2d(grid, self.horizontal, self.vertical)
        h, w = grid.shape[1:3]
        r = self.rate
        if h % r or w % r:
            raise ValueError(f"down_up_rate {r} does not divide the {h}x{w} patch grid")
        coarse = F.avg_pool2d(grid.permute(0, 3, 1, 2), r).permute(0, 2, 3, 1)
        c_bar = clustering_matrix_2d(coarse, self.horizontal, self.vertical)
        rows = torch.arange(h, device=grid.device)[:, None] // r
        cols = torch.arange(w, device=grid.device)[None, :] // r
        coarse_index = (rows * (w // r) + cols).reshape(-1)
        return c_bar[:, coarse_index][:, :, coarse_index]


def stack_clusters(clusters: Tensor, prior: Tensor | None) -> Tensor:
    """Eq. 5: C~(m) = (1 - C(m)) * C~(m-1) + C(m); the first layer has no prior."""
    return clusters if prior is None else (1.0 - clusters) * prior + clusters


class ClusteredSelfAttention(nn.Module):
    """Multi-head self-attention whose post-softmax map is multiplied by the clustering matrix (Eq. 1).

    forward(x [B, T_new, d], clusters [B, T_new, T], allowed [B, T_new, T] bool or None, kv=None)
        -> (y [B, T_new, d], (k, v) [B, h, T, d/h] including the cached past keys/values)
    """

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        if width % heads:
            raise ValueError(f"ClusteredSelfAttention: width {width} not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, clusters: Tensor, allowed: Tensor | None = None,
                kv: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, t_new, d = x.shape
        q, k, v = self.qkv(x).view(b, t_new, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if kv is not None:
            k, v = torch.cat([kv[0], k], 2), torch.cat([kv[1], v], 2)
        dtype = torch.promote_types(q.dtype, torch.float32)
        scores = (q @ k.transpose(-1, -2)).to(dtype) / math.sqrt(d // self.heads)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        attn = self.dropout(scores.softmax(-1) * clusters[:, None].to(dtype))
        y = (attn.to(v.dtype) @ v).transpose(1, 2).reshape(b, t_new, d)
        return self.out(y), (k, v)
