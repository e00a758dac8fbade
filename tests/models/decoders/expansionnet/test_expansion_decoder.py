"""ExpansionDecoder: its parameter count from the architecture (paper Eq. 12 and the layer combination) and its
config check (the decoder_api contract: tests/models/decoders/test_decoder_contract.py)."""
import pytest

import mplug_pretrain  # noqa: F401
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.expansionnet.decoder import ExpansionDecoder
from mplug_pretrain.models.model_config import DecoderConfig


def expected_parameter_count(cfg: DecoderConfig, vocab: int, d: int) -> int:
    linear = d * d + d
    per_layer = (5 * linear + 2 * cfg.expansion_slots * d  # C, K, V1, V2, S + E_Q, E_B
                 + 4 * linear  # cross-attention
                 + 2 * d * cfg.ffn_dim + cfg.ffn_dim + d  # FF
                 + 3 * 2 * d)  # three LayerNorms
    combination = cfg.layers * d * d + d + 2 * d
    head = vocab + (0 if cfg.tie_word_embeddings else vocab * d)
    return vocab * d + cfg.max_positions * d + cfg.layers * per_layer + combination + head


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_the_architecture(tie):
    cfg = DecoderConfig(type="expansion", layers=3, heads=2, ffn_dim=24, max_positions=10, expansion_slots=4,
                        tie_word_embeddings=tie)
    decoder = ExpansionDecoder(cfg, 30, 8)
    assert sum(p.numel() for p in decoder.parameters()) == expected_parameter_count(cfg, 30, 8)
    assert (decoder.lm_head.weight is decoder.embedding.token.weight) == tie


def test_a_width_the_heads_do_not_divide_is_named():
    with pytest.raises(ConfigError, match="decoder.heads"):
        ExpansionDecoder(DecoderConfig(heads=3), 40, 16)
