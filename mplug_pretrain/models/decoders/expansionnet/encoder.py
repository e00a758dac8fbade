"""ExpansionNet v2 encoder: (block) static expansion layers used as a refiner over visual tokens.

Encoder layer n (pre-LN, paper Eq. 11, with the paper's Norm(B_n) typo read as Norm(E_n)):
    E_n = X_{n-1} + StaticExp_n(LN(X_{n-1}))
    X_n = E_n + FF_n(LN(E_n))
Output: X~ = LN(X_N + Dropout(W_enc [X_1; ...; X_N]))  (Sec. 3.4, code form).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.expansionnet.decoder import feed_forward
from mplug_pretrain.models.decoders.expansionnet.layers import LayerCombination, StaticExpansion
from mplug_pretrain.models.model_config import VisualRefinerConfig


class StaticExpansionEncoderLayer(nn.Module):
    """x [B, L, d], key_valid [B, L] bool or None -> [B, L, d] (Eq. 11)."""

    def __init__(self, width: int, group: Sequence[int], ffn_dim: int, dropout: float):
        super().__init__()
        self.norm_expansion = nn.LayerNorm(width)
        self.expansion = StaticExpansion(width, group, dropout)
        self.norm_ffn = nn.LayerNorm(width)
        self.ffn = feed_forward(width, ffn_dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, key_valid: Tensor | None = None) -> Tensor:
        x = x + self.dropout(self.expansion(self.norm_expansion(x), key_valid))
        return x + self.dropout(self.ffn(self.norm_ffn(x)))


class StaticExpansionRefiner(nn.Module):
    """cfg.layers static-expansion encoder layers + layer combination over visual tokens.

    refiner(tokens [B, 1 + M, D]) -> [B, 1 + M, D], M = grid_size ** 2. Static expansion has no notion
    of position, so the CLS token is simply one more token. G = cfg.expansion_group (block static) or
    (cfg.expansion_slots,) when the group is empty (plain static).
    """

    def __init__(self, cfg: VisualRefinerConfig, width: int, grid_size: int, *,
                 ffn_dim: int | None = None, dropout: float = 0.1):
        super().__init__()
        group = tuple(cfg.expansion_group) or (cfg.expansion_slots,)
        if any(int(n) < 1 for n in group):
            raise ConfigError(f"refiner.expansion_group: expected positive slot counts, got {group}")
        if cfg.layers < 1:
            raise ConfigError(f"refiner.layers: expected >= 1, got {cfg.layers}")
        self.tokens = 1 + grid_size ** 2
        self.layers = nn.ModuleList(
            StaticExpansionEncoderLayer(width, group, ffn_dim or 4 * width, dropout) for _ in range(cfg.layers))
        self.combination = LayerCombination(width, cfg.layers, dropout)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 3 or tokens.shape[1] != self.tokens:
            raise ValueError(f"StaticExpansionRefiner: expected tokens [B, {self.tokens}, D] (CLS + grid), "
                             f"got {tuple(tokens.shape)}")
        outputs = []
        x = tokens
        for layer in self.layers:
            x = layer(x)
            outputs.append(x)
        return self.combination(outputs)
