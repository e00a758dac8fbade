"""Our compact BERT (SDPA attention) against transformers' BertModel with the same weights."""
from __future__ import annotations

import torch
from transformers import BertConfig, BertModel

from mplug_pretrain.models.towers.text import TextEncoder
from mplug_pretrain.models.weights.bert import rename_bert_key


def hf_to_text_encoder(sd: dict) -> dict:
    return {rename_bert_key(key): value for key, value in sd.items() if rename_bert_key(key)}


def test_text_encoder_matches_transformers_bert(text_batch):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=64)
    hf = BertModel(config, add_pooling_layer=False).eval()
    ours = TextEncoder(30522, 48, 4, 96, layers=2, max_positions=64, dropout=0.1).eval()
    ours.load_state_dict(hf_to_text_encoder(hf.state_dict()), strict=True)
    ids, mask = text_batch(3, 12)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(ids, mask)
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], atol=1e-5)


def test_padding_does_not_change_real_tokens(text_batch):
    torch.manual_seed(0)
    encoder = TextEncoder(30522, 32, 2, 64, layers=2, max_positions=64, dropout=0.0).eval()
    ids, mask = text_batch(2, 8, min_len=8)
    padded_ids = torch.cat([ids, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    with torch.no_grad():
        assert torch.allclose(encoder(ids, mask), encoder(padded_ids, padded_mask)[:, :8], atol=1e-6)
