"""BERT decoder: parity with transformers' BertLMHeadModel (the contract every decoder head keeps is
tests/models/test_decoder_contract.py)."""
from __future__ import annotations

import torch
from transformers import BertConfig, BertLMHeadModel

from mplug_pretrain.models.bert_decoder import BertDecoder
from mplug_pretrain.models.model_config import DecoderConfig
from mplug_pretrain.models.weights.bert import rename_bert_key, rename_lm_head_key

V, W = 120, 32


def make_decoder(seed: int = 0) -> BertDecoder:
    torch.manual_seed(seed)
    cfg = DecoderConfig(layers=2, heads=4, ffn_dim=64, max_positions=40)
    return BertDecoder(cfg, vocab_size=V, width=W).eval()


def memory_inputs(b: int = 3, m: int = 6):
    g = torch.Generator().manual_seed(1)
    memory = torch.randn(b, m, W, generator=g)
    memory_mask = torch.ones(b, m, dtype=torch.long)
    memory_mask[0, -2:] = 0
    ids = torch.randint(1, V, (b, 9), generator=g)
    return memory, memory_mask, ids


def test_matches_transformers_bert_lm_head_model():
    torch.manual_seed(0)
    hf = BertLMHeadModel(BertConfig(vocab_size=V, hidden_size=W, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, max_position_embeddings=40, is_decoder=True,
                                    add_cross_attention=True)).eval()
    ours = make_decoder()
    state = {}
    for key, value in hf.state_dict().items():
        if key.startswith("bert.") and rename_bert_key(key.removeprefix("bert.")):
            state[rename_bert_key(key.removeprefix("bert."))] = value
        elif key.startswith("cls.predictions.") and rename_lm_head_key(key.removeprefix("cls.predictions.")):
            state["head." + rename_lm_head_key(key.removeprefix("cls.predictions."))] = value
    ours.load_state_dict(state, strict=True)
    memory, memory_mask, ids = memory_inputs()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, encoder_hidden_states=memory,
                      encoder_attention_mask=memory_mask).logits
        got = ours(ids, mask, memory, memory_mask).logits
    assert torch.allclose(got[mask.bool()], expected[mask.bool()], atol=1e-4)
