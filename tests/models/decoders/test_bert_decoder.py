"""BERT decoder: parity with transformers' BertLMHeadModel (the contract every decoder head keeps is
tests/models/decoders/test_decoder_contract.py)."""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from transformers import BertConfig, BertLMHeadModel, DynamicCache, EncoderDecoderCache

from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID, PAD_ID
from mplug_pretrain.models.decoders.bert import BertDecoder
from mplug_pretrain.models.generation.decoding import beam_search
from mplug_pretrain.models.generation.packed_decoding import packed_for_decoding
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


def transformers_and_ours() -> tuple[BertLMHeadModel, BertDecoder]:
    """A random transformers BertLMHeadModel and our decoder holding the same weights."""
    torch.manual_seed(0)
    hf = BertLMHeadModel(BertConfig(vocab_size=V, hidden_size=W, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, max_position_embeddings=40, is_decoder=True,
                                    add_cross_attention=True)).eval()
    return hf, with_weights_of(hf, make_decoder())


def with_weights_of(hf: BertLMHeadModel, ours: BertDecoder) -> BertDecoder:
    """``ours`` holding ``hf``'s weights (BERT key names mapped to ours)."""
    state = {}
    for key, value in hf.state_dict().items():
        if key.startswith("bert.") and rename_bert_key(key.removeprefix("bert.")):
            state[rename_bert_key(key.removeprefix("bert."))] = value
        elif key.startswith("cls.predictions.") and rename_lm_head_key(key.removeprefix("cls.predictions.")):
            state["head." + rename_lm_head_key(key.removeprefix("cls.predictions."))] = value
    ours.load_state_dict(state, strict=True)
    return ours


def test_matches_transformers_bert_lm_head_model():
    hf, ours = transformers_and_ours()
    memory, memory_mask, ids = memory_inputs()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, encoder_hidden_states=memory,
                      encoder_attention_mask=memory_mask).logits
        got = ours(ids, mask, memory, memory_mask).logits
    assert torch.allclose(got[mask.bool()], expected[mask.bool()], atol=1e-4)


def assert_beam_search_equals_generate(hf: BertLMHeadModel, ours: BertDecoder, memory: torch.Tensor,
                                       memory_mask: torch.Tensor, beam: int, length: int, packed: bool) -> None:
    """The bench's setting (``mplug bench generate``): a fixed number of new tokens (EOS blocked until then), so
    every beam has the same length and both rank by summed log-probability; transformers' sequence score is that
    sum divided by the length, as ours with length_penalty 1. ``packed``: ours inside ``packed_for_decoding``."""
    with torch.no_grad():  # our search never emits PAD: make PAD improbable for transformers too
        hf.cls.predictions.bias[PAD_ID] = -1e4
        ours.head.bias[PAD_ID] = -1e4
    ids = torch.full((memory.shape[0], 1), BOS_ID)
    with torch.no_grad():
        theirs = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), encoder_hidden_states=memory,
                             encoder_attention_mask=memory_mask, num_beams=beam, do_sample=False,
                             max_new_tokens=length, min_new_tokens=length, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                             bos_token_id=BOS_ID, length_penalty=1.0, output_scores=True,
                             return_dict_in_generate=True,
                             # a decoder-only config would get a plain DynamicCache, which cross-attention cannot use
                             past_key_values=EncoderDecoderCache(DynamicCache(), DynamicCache()))
    with torch.no_grad(), packed_for_decoding(ours) if packed else nullcontext(ours) as decoder:
        mine = beam_search(decoder, memory, memory_mask, beam_size=beam, max_length=length, min_length=length)
    assert torch.equal(mine.sequences[:, 0], theirs.sequences[:, 1:])
    if beam > 1:  # transformers reports sequence scores for beam search only
        torch.testing.assert_close(mine.scores[:, 0], theirs.sequences_scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("beam", [1, 3, 5])
def test_beam_search_equals_transformers_generate(beam, packed):
    hf, ours = transformers_and_ours()
    memory, memory_mask, _ = memory_inputs()
    assert_beam_search_equals_generate(hf, ours, memory, memory_mask, beam, length=8, packed=packed)


def test_packed_beam_search_equals_transformers_generate_on_the_bench_inputs():
    """The sizes, weights and memory of ``mplug bench generate`` (base width, 6 layers, 262 memory tokens,
    20 tokens), beams 1, 3 and 5, our search packed as the bench times it."""
    from mplug_pretrain.bench import generate as bench
    torch.manual_seed(0)
    size = bench.FULL
    memory = torch.randn(size.batch, size.memory_tokens, size.width)
    memory_mask = torch.ones(size.batch, size.memory_tokens, dtype=torch.long)
    hf = bench.hf_bert_decoder(size)
    ours = with_weights_of(hf, bench.build_decoder("bert", size))
    for beam in bench.BEAMS:
        assert_beam_search_equals_generate(hf, ours, memory, memory_mask, beam, length=size.length, packed=True)
