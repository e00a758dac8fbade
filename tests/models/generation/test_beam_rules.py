"""Beam-search ranking rules on a hand-built decoder whose next-word probabilities are a table of prefixes.

Every expected sequence and score below is worked out by hand from the table and the rule's formula
(not from our own output). The case is built so that beams end at different lengths and the rules disagree.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.api import EOS_ID, PAD_ID, DecoderOutput
from mplug_pretrain.models.generation.beam_official import mplug_official_beam_search
from mplug_pretrain.models.generation.decoding import beam_search, length_normalizer
from mplug_pretrain.models.generation.settings import GenerationSettings

A, B, C = 1000, 2000, 3000
V = 3001
E = EOS_ID
# next-word probabilities after a prefix (BOS not written); a prefix not listed ends at once
TABLE = {
    (): {A: 0.6, B: 0.4},
    (A,): {E: 0.55, C: 0.45},
    (B,): {C: 0.9, E: 0.1},
    (B, C): {E: 0.6, C: 0.4},
    (A, E): {A: 0.7, E: 0.3},  # only the official rule extends a beam after its [SEP]
    (A, E, A): {B: 0.8, E: 0.2},
    (B, C, E): {E: 0.9, C: 0.1},
    (A, C): {E: 0.5, A: 0.5},
    (B, C, C): {E: 1.0},
}


class TableDecoder(nn.Module):
    """decoder_api decoder: log-probs read from TABLE by the tokens so far; the cache is the token history."""

    def forward(self, input_ids, attention_mask, memory, memory_mask, past=None, use_cache=False):
        history = input_ids if past is None else torch.cat([past, input_ids], dim=1)
        logits = torch.full((history.shape[0], input_ids.shape[1], V), -1e9)
        for row in range(history.shape[0]):
            for t in range(input_ids.shape[1]):
                position = history.shape[1] - input_ids.shape[1] + t
                prefix = tuple(history[row, 1:position + 1].tolist())
                for word, p in TABLE.get(prefix, {E: 1.0}).items():
                    logits[row, t, word] = math.log(p)
        return DecoderOutput(logits, history if use_cache else None)

    def reorder_cache(self, past, index):
        return past[index]


def gnmt(length, alpha=0.6):
    return ((5 + length) / 6) ** alpha


def run(search, **kwargs):
    memory, memory_mask = torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.long)
    return search(TableDecoder(), memory, memory_mask, beam_size=2, max_length=6, **kwargs)


def _tokens(sequence_row):
    return [t for t in sequence_row.tolist() if t != PAD_ID]


def test_official_rule_pools_finished_beams_and_stops_when_the_top_beam_ends():
    # step 1: beams (B C) .36 and (A E) .33; (A E) ends -> pool, score log .33 / lp(2)
    # step 2: (A E A) .231 and (B C E) .216; (B C E) ends -> pool, log .216 / lp(3)
    # step 3: (B C E E) .1944 is the top beam and ends: stop; both beams join the pool at lp(4):
    #         (B C E E) log .1944 / lp(4), (A E A B) log .1848 / lp(4)
    pool = sorted([(math.log(0.6 * 0.55) / gnmt(2), [A, E]),
                   (math.log(0.4 * 0.9 * 0.6) / gnmt(3), [B, C, E]),
                   (math.log(0.4 * 0.9 * 0.6 * 0.9) / gnmt(4), [B, C, E]),  # cut after its first [SEP]
                   (math.log(0.6 * 0.55 * 0.7 * 0.8) / gnmt(4), [A, E])], key=lambda h: -h[0])
    out = run(mplug_official_beam_search, alpha=0.6, num_return=2)
    assert _tokens(out.sequences[0, 0]) == [A, E]
    assert out.scores[0].tolist() == pytest.approx([pool[0][0], pool[1][0]], abs=1e-5)
    assert _tokens(out.sequences[0, 1]) == pool[1][1]


def test_our_default_rule_ranks_by_mean_log_prob_after_every_beam_ended():
    # frozen finished beams: step 1 keeps (B C) .36 and (A E) .33; step 2: (A E) .33 [frozen], (B C E) .216
    # -> all ended; mean log-prob: (B C E) log .216 / 3 = -0.511 beats (A E) log .33 / 2 = -0.554
    out = run(beam_search, length_penalty=1.0, num_return=2)
    assert _tokens(out.sequences[0, 0]) == [B, C, E]
    assert out.scores[0].tolist() == pytest.approx([math.log(0.216) / 3, math.log(0.33) / 2], abs=1e-5)


def test_gnmt_form_with_early_stopping_stops_when_the_best_normalized_beam_ended():
    # step 1: (B C) log .36 / lp(2) = -0.931 beats the ended (A E) -1.011: go on
    # step 2: (A E) -1.011 [frozen] beats (B C E) log .216 / lp(3) = -1.289 and has ended: stop
    out = run(beam_search, length_penalty=0.6, length_penalty_form="gnmt", early_stopping=True, num_return=2)
    assert _tokens(out.sequences[0, 0]) == [A, E]
    assert out.scores[0].tolist() == pytest.approx([math.log(0.33) / gnmt(2), math.log(0.216) / gnmt(3)],
                                                   abs=1e-5)


def test_length_normalizer_forms():
    lengths = torch.tensor([1, 4, 9])
    assert length_normalizer(lengths, 0.6, "power").tolist() == pytest.approx([1, 4 ** 0.6, 9 ** 0.6])
    assert length_normalizer(lengths, 0.6, "gnmt").tolist() == pytest.approx([1, 1.5 ** 0.6, (14 / 6) ** 0.6])


def test_settings_dispatch_to_the_official_rule_and_refuse_a_half_official_one():
    settings = GenerationSettings(beam_size=2, max_length=6, min_length=0, length_penalty=0.6,
                                  length_penalty_form="gnmt", early_stopping=True, rule="mplug_official")
    settings.validate("caption.generation")
    memory, memory_mask = torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.long)
    out = settings.beam_search(TableDecoder(), memory, memory_mask)
    assert out.scores[0, 0].item() == pytest.approx(math.log(0.33) / gnmt(2), abs=1e-5)
    with pytest.raises(ConfigError, match="caption.generation.rule"):
        GenerationSettings(rule="mplug_official").validate("caption.generation")
