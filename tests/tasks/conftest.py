"""Shared fixtures for the task tests."""
import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.models.presets import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model folder with seeded random weights (save_pretrained)."""
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    build_model("tiny").save_pretrained(path)
    return path
