"""`init_from` with another decoder.type silently dropped the pretrained decoder (issue 26): now the captioner
logs what it did not load, counted from the folder's own weights file."""
from __future__ import annotations

import copy
import logging

import torch
from safetensors import safe_open

from mplug_pretrain.models.presets import build_model, get_preset_config
from mplug_pretrain.tasks.caption.model import load_caption_model


def test_a_pretrained_decoder_of_another_type_is_reported(tmp_path, caplog):
    torch.manual_seed(0)
    build_model("tiny").save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        decoder_tensors = sum(k.startswith("decoder.") for k in f.keys())  # noqa: SIM118 (no __iter__)
    assert decoder_tensors > 0
    same = get_preset_config("tiny")
    with caplog.at_level(logging.WARNING, logger="mplug_pretrain.tasks.caption.model"):
        load_caption_model(str(tmp_path), same)
    assert not caplog.records  # same decoder type: everything loaded, nothing to say
    other = copy.deepcopy(same)
    other.decoder.type = "expansion"
    with caplog.at_level(logging.WARNING, logger="mplug_pretrain.tasks.caption.model"):
        model = load_caption_model(str(tmp_path), other)
    [record] = caplog.records
    message = record.getMessage()
    assert f"its decoder 'bert' ({decoder_tensors} tensors) is not loaded" in message
    assert "model.decoder.type is 'expansion'" in message and "model.decoder.type=bert" in message
    assert model.config.decoder.type == "expansion"
