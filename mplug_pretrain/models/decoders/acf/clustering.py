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

formula="official" reproduces the official code (ZihuaEvan/ACFModel, Image_captioning/models/ACFModel.py,
``GroupAttention_one_dim`` / ``GroupAttention_two_dim_FC``, the code behind the published numbers). Where it
is not the paper:
  (a) the span mean includes s_k:            P~(s_k | i) = sigmoid(FC([s_k, mean(s_i..s_k)]))   (paper: ..s_{k-1})
  (b) k = i contributes a factor:            sigmoid(FC([s_i, s_i])) multiplies every C_ij, j > i
      (C_ij = prod_{k=i..j} M~_ik for j > i; the diagonal is still set to C_ii = 1)
  (c) the estimator layer-normalises its own input first, with the code's LayerNorm
      a * (x - mean) / (std + 1e-6) + b, std the UNBIASED standard deviation (not nn.LayerNorm)
  (d) stacking acts on the merge probabilities, before the cumulative product:
      M~(m) = M~(m-1) + (1 - M~(m-1)) * M(m),  M~(0) = 0,   C(m) = cumulative product of M~(m)
      (paper, Eq. 5: C~(m) = (1 - C(m)) C~(m-1) + C(m) on the finished matrices); C(m) is used as is
  (e) 2-D: ONE FC shared by the horizontal and the vertical direction (paper reading: one FC each);
      the 2-D estimator layer-normalises once, before Down-Up pooling, and carries one merge prior
      per direction (M~h per row, M~v per column) to the next layer.
  (f) the code's ``masked_fill(context_mean == 0, 0)`` also zeroes a component of s_k whenever the same
      component of the span mean is exactly 0.0 (measure zero for real inputs); not reproduced.
The official 2-D code is not a valid clustering matrix over the patch tokens; these parts are NOT
reproduced (official mode keeps the paper's token-pair construction with (a)-(e) inside):
  - ``meanpool`` reshapes [B, N, d] to [B, d, g, g] without a permute, so the "pooled grid" mixes
    channels of different patches; we average-pool the spatial grid (down_up_rate, default 1; the
    official code always pools by 2).
  - the cumulative product runs over dim 2 of the [B, row, i, k] merge tensor, i.e. over the span START i
    (G_ik = prod_{i' <= i} M_i'k) instead of the span end k, so G is neither decreasing with distance nor
    the probability of a span; we take the product over k as in the 1-D code.
  - the 4-D tensor G_h[row x]_ij * G_v[col i]_xy is flattened as rows (i, j) x columns (x, y), i.e. two
    column indices against two row indices, not (token p, token q); the result is not symmetric and row
    p = (I, J) is not the token (row I, col J). The nearest up-sampling also tiles (repeat) the first index
    instead of replicating it. We use C_pq = C^h[row min(x,y)]_ij * C^v[col min(i,j)]_xy as in paper mode.
Official weights map as: group_attn.fc -> clusters.fc, group_attn.norm.a_2 / b_2 -> clusters.norm.weight / bias
(2-D: clusters.shared.fc, clusters.norm), self_attn.linears.0/1/2 -> attention.qkv (concatenated, q k v),
self_attn.linears.3 -> attention.out.
Not part of the estimator and not changed by the formula switch: the official layers are pre-LN with a
final LayerNorm and a GELU feed-forward, and the official decoder predicts through an appended [MASK] token.
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


FORMULAS = ("paper", "official")


def check_formula(formula: str) -> str:
    if formula not in FORMULAS:
        raise ValueError(f"acf formula: expected paper | official, got {formula!r}")
    return formula


class OfficialLayerNorm(nn.Module):
    """The official ACF code's LayerNorm: weight * (x - mean) / (std + eps) + bias, std unbiased. x [..., d]."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return self.weight.to(x.dtype) * centred / (x.std(-1, keepdim=True) + self.eps) + self.bias.to(x.dtype)


class ClusterEstimator1D(nn.Module):
    """The 1-D clustering matrix of Eq. 2-4 for one layer (formula "paper" or "official", module docstring).

    forward(x [B, N, d], merge_prior=None, return_merges=False) -> C [B, N, N] (symmetric, unit diagonal,
    values in [0, 1]), and with return_merges the official stacked merge probabilities M~ [B, N, N]
    ([i, k], valid for k >= i; None in paper mode). merge_prior: the previous layer's M~ (official only).
    causal_rows(x_new [B, T_new, d], state, merge_prior [B, T, T_new] or None) -> (rows [B, T_new, T] with
    rows[q, i] = C[T_past + q, i] for i <= T_past + q and 0 beyond, new state, M~ columns [B, T, T_new] or None);
    chunks fed with the state equal the full matrix.
    """

    def __init__(self, width: int, formula: str = "paper", normalize_input: bool | None = None):
        super().__init__()
        self.width = width
        self.official = check_formula(formula) == "official"
        self.fc = nn.Linear(2 * width, 1)  # FC([s_k, span mean])
        normalize_input = self.official if normalize_input is None else normalize_input
        self.norm = OfficialLayerNorm(width) if normalize_input else None

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(w_a . s_k, w_b . s_k): [B, T] each, in fp32 (fp64 for fp64 input)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.to(dtype) if self.norm is None else self.norm(x.to(dtype))
            ab = x @ self.fc.weight.to(dtype).view(2, self.width).t()
        return ab[..., 0], ab[..., 1]

    def _log_columns(self, a_new: Tensor, prefix: Tensor, base: Tensor,
                     merge_prior: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """log of the running products for all i < T and the last T_new positions j: [B, T, T_new], valid
        where i <= j (paper: prod over k = i+1..j; official: over k = i..j, the diagonal is reset by callers).

        a_new [B, T_new] (w_a . s_j of the new positions), prefix [B, T + 1], base [B, T] (the running log
        product at column T_past - 1 for i < T_past, 0 for the new positions), merge_prior [B, T, T_new].
        Also returns the official stacked merge probabilities M~ [B, T, T_new] (None in paper mode).
        """
        t_total, t_new = prefix.shape[1] - 1, a_new.shape[1]
        start = t_total - t_new
        i = torch.arange(t_total, device=prefix.device)[:, None]
        k = torch.arange(start, t_total, device=prefix.device)[None, :]
        bias = self.fc.bias.to(a_new.dtype)
        if not self.official:
            span_mean = (prefix[:, None, start:t_total] - prefix[:, :t_total, None]) / (k - i).clamp(min=1)
            log_merge = F.logsigmoid(a_new[:, None, :] + span_mean + bias)  # log P(s_k | s_i..s_{k-1})
            return base[:, :, None] + log_merge.masked_fill(k <= i, 0.0).cumsum(-1), None
        span_mean = (prefix[:, None, start + 1:] - prefix[:, :t_total, None]) / (k - i + 1).clamp(min=1)
        logit = a_new[:, None, :] + span_mean + bias  # FC([s_k, mean(s_i..s_k)])
        if merge_prior is None:
            merges, log_merge = torch.sigmoid(logit), F.logsigmoid(logit)
        else:
            prior = merge_prior.to(logit.dtype)
            merges = prior + (1.0 - prior) * torch.sigmoid(logit)
            log_merge = torch.logaddexp(prior.clamp_min(torch.finfo(prior.dtype).tiny).log(),
                                        torch.log1p(-prior) + F.logsigmoid(logit))
        return base[:, :, None] + log_merge.masked_fill(k < i, 0.0).cumsum(-1), merges

    def forward(self, x: Tensor, merge_prior: Tensor | None = None,
                return_merges: bool = False) -> Tensor | tuple[Tensor, Tensor | None]:
        if merge_prior is not None and not self.official:
            raise ValueError("ClusterEstimator1D: a merge prior needs formula='official'")
        a, p = self._project(x)
        prefix = F.pad(p.cumsum(-1), (1, 0))
        log_c, merges = self._log_columns(a, prefix, torch.zeros_like(a), merge_prior)
        upper = log_c.exp()  # [i, j] valid for j >= i
        n = x.shape[1]
        idx = torch.arange(n, device=x.device)
        c = torch.where(idx[None, :] > idx[:, None], upper, upper.transpose(-1, -2))
        c = c.masked_fill(idx[None, :] == idx[:, None], 1.0)
        return (c, merges) if return_merges else c

    def causal_rows(self, x_new: Tensor, state: ClusterState | None = None,
                    merge_prior: Tensor | None = None) -> tuple[Tensor, ClusterState, Tensor | None]:
        if merge_prior is not None and not self.official:
            raise ValueError("ClusterEstimator1D: a merge prior needs formula='official'")
        a, p = self._project(x_new)
        t_new = a.shape[1]
        if state is None:
            prefix, base = F.pad(p.cumsum(-1), (1, 0)), torch.zeros_like(a)
        else:
            prefix = torch.cat([state.prefix, state.prefix[:, -1:] + p.cumsum(-1)], 1)
            base = torch.cat([state.last_column, torch.zeros_like(a)], 1)
        log_c, merges = self._log_columns(a, prefix, base, merge_prior)  # [B, T, T_new]
        t_total = log_c.shape[1]
        i = torch.arange(t_total, device=x_new.device)[None, :]
        j = torch.arange(t_total - t_new, t_total, device=x_new.device)[:, None]
        rows = log_c.transpose(-1, -2).exp().masked_fill(i > j, 0.0).masked_fill(i == j, 1.0)
        return rows, ClusterState(prefix, log_c[:, :, -1]), merges


MergePriors2D = tuple  # (M~h [B, H, W, W] per row, M~v [B, W, H, H] per column), official 2-D only


def clustering_matrix_2d(grid: Tensor, horizontal: ClusterEstimator1D, vertical: ClusterEstimator1D,
                         merge_prior: MergePriors2D | None = None) -> tuple[Tensor, MergePriors2D | None]:
    """Eq. 7 with the top-most-row / left-most-column rule. grid [B, H, W, d] -> (C [B, H*W, H*W] (row-major),
    official merge probabilities (M~h [B, H, W, W], M~v [B, W, H, H]) or None in paper mode)."""
    b, h, w, d = grid.shape
    prior_h, prior_v = (None, None) if merge_prior is None else (
        merge_prior[0].reshape(b * h, w, w), merge_prior[1].reshape(b * w, h, h))
    c_h, m_h = horizontal(grid.reshape(b * h, w, d), prior_h, return_merges=True)  # per row x: columns i, j
    c_v, m_v = vertical(grid.transpose(1, 2).reshape(b * w, h, d), prior_v, return_merges=True)  # per column i
    c_h, c_v = c_h.view(b, h, w, w), c_v.view(b, w, h, h)
    rows, cols = torch.arange(h, device=grid.device), torch.arange(w, device=grid.device)
    top_row = torch.minimum(rows[:, None], rows[None, :])  # [H, H]: min(x, y)
    left_col = torch.minimum(cols[:, None], cols[None, :])  # [W, W]: min(i, j)
    horizontal_part = c_h[:, top_row].permute(0, 1, 3, 2, 4)  # [B, x, y, i, j] -> [B, x, i, y, j]
    vertical_part = c_v[:, left_col].permute(0, 3, 1, 4, 2)  # [B, i, j, x, y] -> [B, x, i, y, j]
    merges = None if m_h is None else (m_h.view(b, h, w, w), m_v.view(b, w, h, h))
    return (horizontal_part * vertical_part).reshape(b, h * w, h * w), merges


class ClusterEstimator2D(nn.Module):
    """2-D clustering matrix: separate horizontal and vertical FCs (paper) or one shared FC after the
    official LayerNorm (official, module docstring).

    forward(grid [B, H, W, d], merge_prior=None, return_merges=False) -> C [B, H*W, H*W] (and the official
    per-direction merge probabilities, see clustering_matrix_2d, computed on the pooled grid). down_up_rate
    r > 1: C is computed on the r x r average-pooled grid and replicated back, C_pq = C_bar[coarse(p),
    coarse(q)] (the paper's Down-Up sampling).
    """

    def __init__(self, width: int, down_up_rate: int = 1, formula: str = "paper"):
        super().__init__()
        if down_up_rate < 1:
            raise ValueError(f"down_up_rate: expected >= 1, got {down_up_rate}")
        self.rate = down_up_rate
        self.official = check_formula(formula) == "official"
        if self.official:
            self.norm = OfficialLayerNorm(width)  # once, before pooling, as in the official code
            self.shared = ClusterEstimator1D(width, "official", normalize_input=False)
        else:
            self.horizontal = ClusterEstimator1D(width)
            self.vertical = ClusterEstimator1D(width)

    def _directions(self) -> tuple[ClusterEstimator1D, ClusterEstimator1D]:
        return (self.shared, self.shared) if self.official else (self.horizontal, self.vertical)

    def forward(self, grid: Tensor, merge_prior: MergePriors2D | None = None,
                return_merges: bool = False) -> Tensor | tuple[Tensor, MergePriors2D | None]:
        if merge_prior is not None and not self.official:
            raise ValueError("ClusterEstimator2D: a merge prior needs formula='official'")
        if self.official:
            with torch.autocast(device_type=grid.device.type, enabled=False):
                grid = self.norm(grid.to(torch.promote_types(grid.dtype, torch.float32)))
        h, w = grid.shape[1:3]
        r = self.rate
        if r > 1 and (h % r or w % r):
            raise ValueError(f"down_up_rate {r} does not divide the {h}x{w} patch grid")
        coarse = grid if r == 1 else F.avg_pool2d(grid.permute(0, 3, 1, 2), r).permute(0, 2, 3, 1)
        c_bar, merges = clustering_matrix_2d(coarse, *self._directions(), merge_prior)
        if r > 1:
            rows = torch.arange(h, device=grid.device)[:, None] // r
            cols = torch.arange(w, device=grid.device)[None, :] // r
            coarse_index = (rows * (w // r) + cols).reshape(-1)
            c_bar = c_bar[:, coarse_index][:, :, coarse_index]
        return (c_bar, merges) if return_merges else c_bar


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
