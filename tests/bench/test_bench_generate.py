"""Benchmarks `generate` and `feature-cache` (quick sizes), and the no-cache decoding they time: it must
produce the same beams as decoding with each decoder's cache."""
import json

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.bench import feature_cache as feature_cache_bench
from mplug_pretrain.bench import generate as generate_bench
from mplug_pretrain.models.generation.decoding import beam_search

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", generate_bench.DECODERS)
def test_decoding_without_cache_finds_the_same_beams(kind):
    torch.manual_seed(0)
    size = generate_bench.QUICK
    decoder = generate_bench.build_decoder(kind, size)
    memory = torch.randn(2, size.memory_tokens, size.width)
    mask = torch.ones(2, size.memory_tokens, dtype=torch.long)
    mask[1, -3:] = 0
    cached = beam_search(decoder, memory, mask, beam_size=3, max_length=6, num_return=3)
    full = beam_search(generate_bench.FullRecompute(decoder), memory, mask, beam_size=3, max_length=6, num_return=3)
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(cached.scores, full.scores, rtol=1e-4, atol=1e-4)


def test_generate_bench_rows(tmp_path):
    out = tmp_path / "generate.json"
    result = generate_bench.run(str(out), quick=True)
    rows = result["rows"]
    ours = [r for r in rows if r["implementation"] == "ours"]
    theirs = [r for r in rows if r["implementation"] == "transformers"]
    assert {(r["decoder"], r["beam"], r["cache"]) for r in ours} == {
        (d, b, c) for d in ("bert", "expansion", "acf") for b in (1, 3, 5) for c in (True, False)}
    assert {(r["beam"], r["cache"]) for r in theirs} == {(b, c) for b in (1, 3, 5) for c in (True, False)}
    cached_bert = [r for r in ours if r["decoder"] == "bert" and r["cache"]]  # packed and plain per beam width
    assert sorted((r["beam"], r["packed"]) for r in cached_bert) == [(b, p) for b in (1, 3, 5) for p in (False, True)]
    assert all(r["first_call_captions_per_s"] > 0 for r in cached_bert if r["packed"])
    assert all(r["captions_per_s"] > 0 and r["parameters"] > 0 for r in rows)
    with open(out) as f:
        assert json.load(f)["bench"] == "generate"


def test_feature_cache_bench_rows(tmp_path):
    result = feature_cache_bench.run(str(tmp_path / "feature_cache.json"), quick=True)
    assert {(r["mode"], r["objective"]) for r in result["rows"]} == {
        (m, o) for m in ("end_to_end", "frozen_encoder", "cached_features") for o in ("xe", "scst")}
    assert all(r["seconds_per_step"] > 0 for r in result["rows"])
    trainable = {r["mode"]: r["trainable_parameters"] for r in result["rows"]}
    vit = sum(p.numel() for p in feature_cache_bench._model(True).image_encoder.vit.parameters())
    assert trainable["end_to_end"] - trainable["frozen_encoder"] == vit  # exactly the ViT is frozen
    assert trainable["frozen_encoder"] == trainable["cached_features"]
    # every derived figure recomputed from the raw step timings of the rows
    per_image = {f"{r['objective']}_{'cached' if r['mode'] == 'cached_features' else r['mode']}":
                 r["seconds_per_step"] / r["batch_size"] for r in result["rows"]}
    estimate = result["recipe_estimate"]
    assert {k: v for k, v in estimate["per_image_seconds"].items() if k != "caching"} == pytest.approx(per_image)
    fast = sum(n * estimate["per_image_seconds"][k] for k, n in feature_cache_bench.FAST_RECIPE.items())
    standard = sum(n * estimate["per_image_seconds"][k] for k, n in feature_cache_bench.STANDARD_RECIPE.items())
    assert estimate["seconds_per_training_image"] == pytest.approx({"fast_recipe": fast, "standard_recipe": standard})
    assert estimate["speedup"] == pytest.approx(standard / fast)
    assert result["step_speedup_cached_vs_end_to_end"] == pytest.approx(
        {o: per_image[f"{o}_end_to_end"] / per_image[f"{o}_cached"] for o in ("xe", "scst")})
