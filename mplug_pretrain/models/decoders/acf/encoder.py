"""ACF encoder: 2-D adaptive clustering self-attention over the visual patch grid (refiner).

Layer m (post-LN, "Add & LN" as in the paper's Fig. 3), x = [CLS; patches] [B, 1 + g*g, d]:
    C(m)  = 2-D clustering matrix of the patch grid of x (Eq. 6/7), padded with ones for CLS
    C~(m) = (1 - C(m)) C~(m-1) + C(m)                                     (Eq. 5)
    x     = LN(x + ClusteredSelfAttention(x, C~(m)))                      (Eq. 1)
    x     = LN(x + FF(x))
The CLS token is a global token: it clusters with every patch (row and column of ones), so it
attends, and is attended to, with plain softmax weights.
cfg.acf_formula = "official": C(m) comes from the official estimator (models/acf.py), which stacks the
previous layer's merge probabilities (one per direction) instead of C~(m-1), and C(m) is used as is.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.acf.clustering import (
    FORMULAS,
    ClusteredSelfAttention,
    ClusterEstimator2D,
    stack_clusters,
)
from mplug_pretrain.models.decoders.expansionnet.decoder import feed_forward
from mplug_pretrain.models.model_config import VisualRefinerConfig


class ACFEncoderLayer(nn.Module):
    """x [B, 1 + g*g, d], prior or None -> (x, clusters [B, 1 + g*g, 1 + g*g] used by the attention, next prior).

    paper: prior = C~(m-1), clusters = next prior = C~(m). official: prior = the previous layer's merge
    probabilities (M~h, M~v), clusters = C(m).
    """

    def __init__(self, width: int, heads: int, ffn_dim: int, dropout: float, grid_size: int, down_up_rate: int,
                 formula: str = "paper"):
        super().__init__()
        self.grid_size = grid_size
        self.official = formula == "official"
        self.clusters = ClusterEstimator2D(width, down_up_rate, formula)
        self.attention = ClusteredSelfAttention(width, heads, dropout)
        self.norm_attention = nn.LayerNorm(width)
        self.ffn = feed_forward(width, ffn_dim, dropout)
        self.norm_ffn = nn.LayerNorm(width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, prior) -> tuple[Tensor, Tensor, object]:
        b, _, d = x.shape
        grid = x[:, 1:].reshape(b, self.grid_size, self.grid_size, d)
        if self.official:
            patch_clusters, next_prior = self.clusters(grid, prior, return_merges=True)
            clusters = F.pad(patch_clusters, (1, 0, 1, 0), value=1.0)
        else:
            clusters = next_prior = stack_clusters(F.pad(self.clusters(grid), (1, 0, 1, 0), value=1.0), prior)
        h, _ = self.attention(x, clusters)
        x = self.norm_attention(x + self.dropout(h))
        return self.norm_ffn(x + self.dropout(self.ffn(x))), clusters, next_prior


class ACFVisualRefiner(nn.Module):
    """cfg.layers ACF encoder layers over visual tokens: refiner(tokens [B, 1 + M, D]) -> [B, 1 + M, D].

    M = grid_size ** 2 patches in row-major order after one CLS token. heads default to width // 64,
    ffn_dim to 4 * width; down_up_rate > 1 enables Down-Up sampling of the clustering matrix;
    cfg.acf_formula picks the paper's or the official estimator and stacking.
    """

    def __init__(self, cfg: VisualRefinerConfig, width: int, grid_size: int, *, heads: int | None = None,
                 ffn_dim: int | None = None, dropout: float = 0.1, down_up_rate: int = 1):
        super().__init__()
        heads = heads or max(1, width // 64)
        if width % heads:
            raise ConfigError(f"refiner: width {width} not divisible by heads {heads}")
        if cfg.layers < 1:
            raise ConfigError(f"refiner.layers: expected >= 1, got {cfg.layers}")
        formula = getattr(cfg, "acf_formula", "paper")
        if formula not in FORMULAS:
            raise ConfigError(f"refiner.acf_formula: expected paper | official, got {formula!r}")
        if grid_size % down_up_rate:
            raise ConfigError(f"refiner: down_up_rate {down_up_rate} does not divide grid_size {grid_size}")
        self.tokens = 1 + grid_size ** 2
        self.layers = nn.ModuleList(
            ACFEncoderLayer(width, heads, ffn_dim or 4 * width, dropout, grid_size, down_up_rate, formula)
            for _ in range(cfg.layers))

    def forward(self, tokens: Tensor, return_clusters: bool = False) -> Tensor | tuple[Tensor, list[Tensor]]:
        """return_clusters=True also returns every layer's clustering matrix used by its attention (C~ in paper
        mode, C in official mode), for inspection."""
        if tokens.dim() != 3 or tokens.shape[1] != self.tokens:
            raise ValueError(f"ACFVisualRefiner: expected tokens [B, {self.tokens}, D] (CLS + grid), "
                             f"got {tuple(tokens.shape)}")
        x, prior, stacked = tokens, None, []
        for layer in self.layers:
            x, clusters, prior = layer(x, prior)
            stacked.append(clusters)
        return (x, stacked) if return_clusters else x
