"""save_pretrained -> from_pretrained for every decoder type, with the decoder's output projection tied to
its token embedding (issue 20 item 1: the expansion and ACF decoders share one tensor under two names)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from mplug_pretrain.models.mplug import MPLUG, WEIGHTS_FILE
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.models.weights.reader import tied_aliases


def decoder_output_and_token_embedding(model: MPLUG) -> tuple[torch.Tensor, torch.Tensor]:
    """(the decoder's output projection [V, D], its token embedding [V, D]) whatever the decoder type."""
    d = model.decoder
    if model.config.decoder.type == "bert":
        embedding = d.embeddings.word_embeddings.weight
        return (d.head.weight if d.head.weight is not None else embedding), embedding
    return d.lm_head.weight, d.embedding.token.weight


@pytest.mark.parametrize("decoder", ["bert", "expansion", "acf"])
def test_tied_decoder_round_trips_through_save_pretrained(decoder, text_batch, tmp_path):
    torch.manual_seed(0)
    model = build_model("tiny", decoder={"type": decoder, "layers": 2, "tie_word_embeddings": True}).eval()
    head, embedding = decoder_output_and_token_embedding(model)
    assert head.data_ptr() == embedding.data_ptr()
    model.save_pretrained(str(tmp_path))
    loaded = MPLUG.from_pretrained(str(tmp_path)).eval()

    head, embedding = decoder_output_and_token_embedding(loaded)
    assert head is embedding, "the tie must survive loading"
    saved = model.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, saved[key]), key
    with safe_open(str(tmp_path / WEIGHTS_FILE), "pt") as f:  # every tensor stored once
        stored = set(f.keys())
    assert stored == set(saved) - set(tied_aliases(model))

    ids, mask = text_batch(3, 9, seed=1)
    image = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        losses = [m.caption_loss(image, ids, mask, prompt_length=2) for m in (model, loaded)]
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])


def test_untied_expansion_decoder_stores_both_matrices(tmp_path):
    torch.manual_seed(0)
    model = build_model("tiny", decoder={"type": "expansion", "layers": 1, "tie_word_embeddings": False})
    assert tied_aliases(model) == {}
    model.save_pretrained(str(tmp_path))
    loaded = MPLUG.from_pretrained(str(tmp_path))
    head, embedding = decoder_output_and_token_embedding(loaded)
    assert head is not embedding and torch.equal(head, model.decoder.lm_head.weight)


def test_weights_missing_from_the_file_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    model = build_model("tiny", decoder={"type": "acf", "layers": 1})
    model.save_pretrained(str(tmp_path))
    state = load_file(str(tmp_path / WEIGHTS_FILE))
    del state["decoder.embedding.token.weight"]  # the kept name of the tied pair: nothing can fill it
    save_file(state, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(RuntimeError, match="decoder.embedding.token.weight"):
        MPLUG.from_pretrained(str(tmp_path))
