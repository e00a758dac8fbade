"""BERT decoder: transformers parity, causality, KV cache == full recomputation, cache reordering, factory."""
from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertLMHeadModel

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.bert_decoder import BertDecoder
from mplug_pretrain.models.decoder_factory import build_decoder, build_visual_refiner
from mplug_pretrain.models.model_config import DecoderConfig, VisualRefinerConfig
from mplug_pretrain.models.weights.bert import rename_embedding_key, rename_layer_key, rename_lm_head_key

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
        if key.startswith("bert.embeddings.") and rename_embedding_key(key[len("bert.embeddings."):]):
            state["embeddings." + rename_embedding_key(key[len("bert.embeddings."):])] = value
        elif key.startswith("bert.encoder.layer."):
            _, _, _, index, rest = key.split(".", 4)
            state[f"layers.{index}.{rename_layer_key(rest)}"] = value
        elif key.startswith("cls.predictions.") and rename_lm_head_key(key[len("cls.predictions."):]):
            state["head." + rename_lm_head_key(key[len("cls.predictions."):])] = value
    ours.load_state_dict(state, strict=True)
    memory, memory_mask, ids = memory_inputs()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, encoder_hidden_states=memory,
                      encoder_attention_mask=memory_mask).logits
        got = ours(ids, mask, memory, memory_mask).logits
    assert torch.allclose(got[mask.bool()], expected[mask.bool()], atol=1e-4)


def test_changing_a_future_token_never_changes_earlier_logits():
    decoder = make_decoder()
    memory, memory_mask, ids = memory_inputs()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        base = decoder(ids, mask, memory, memory_mask).logits
        for t in range(ids.shape[1]):
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 7) % V
            logits = decoder(changed, mask, memory, memory_mask).logits
            assert torch.equal(logits[:, :t], base[:, :t])
            assert not torch.allclose(logits[:, t], base[:, t])


def test_cached_incremental_decoding_equals_full_recomputation():
    decoder = make_decoder()
    memory, memory_mask, ids = memory_inputs()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = decoder(ids, mask, memory, memory_mask).logits
        out = decoder(ids[:, :3], mask[:, :3], memory, memory_mask, use_cache=True)  # a prompt, then 1 by 1
        steps, past = [out.logits], out.past
        for t in range(3, ids.shape[1]):
            out = decoder(ids[:, t:t + 1], mask[:, :t + 1], memory, memory_mask, past=past, use_cache=True)
            steps.append(out.logits)
            past = out.past
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5


def test_reorder_cache_selects_rows():
    decoder = make_decoder()
    memory, memory_mask, ids = memory_inputs()
    mask = torch.ones_like(ids)
    index = torch.tensor([2, 0, 0])
    with torch.no_grad():
        past = decoder(ids[:, :4], mask[:, :4], memory, memory_mask, use_cache=True).past
        past = decoder.reorder_cache(past, index)
        step = decoder(ids[index, 4:5], mask[:, :5], memory[index], memory_mask[index], past=past, use_cache=True)
        full = decoder(ids[index, :5], mask[:, :5], memory[index], memory_mask[index]).logits[:, -1:]
    assert (step.logits - full).abs().max() <= 1e-5


def test_mask_length_is_checked():
    decoder = make_decoder()
    memory, memory_mask, ids = memory_inputs()
    with pytest.raises(ValueError, match="T_past"):
        decoder(ids, torch.ones(3, 4, dtype=torch.long), memory, memory_mask)


def test_factory_builds_bert_and_rejects_unknown():
    assert isinstance(build_decoder(DecoderConfig(layers=1, heads=2, ffn_dim=8), vocab_size=10, width=8), BertDecoder)
    with pytest.raises(ConfigError, match="model.decoder.type"):
        build_decoder(DecoderConfig(type="lstm"), vocab_size=10, width=8)
    assert build_visual_refiner(VisualRefinerConfig(), width=8, grid_size=2) is None
    with pytest.raises(ConfigError, match="model.refiner.type"):
        build_visual_refiner(VisualRefinerConfig(type="pool"), width=8, grid_size=2)
