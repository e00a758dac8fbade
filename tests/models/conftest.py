"""Shared fixtures for the model tests: small text batches in the tokenizer's layout and one tiny MPLUG."""
from __future__ import annotations

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim before timm / open_clip)
from mplug_pretrain.models.decoder_api import BOS_ID, EOS_ID, PAD_ID


def make_text_batch(batch: int, max_len: int, seed: int = 0, min_len: int = 4,
                    vocab: tuple[int, int] = (1000, 30000)) -> tuple[torch.Tensor, torch.Tensor]:
    """[CLS] random word ids [SEP] [PAD]...: ids and mask [batch, max_len], lengths in [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    lengths[0] = max_len
    ids = torch.randint(vocab[0], vocab[1], (batch, max_len), generator=g)
    mask = (torch.arange(max_len)[None] < lengths[:, None]).long()
    ids[:, 0] = BOS_ID
    ids[torch.arange(batch), lengths - 1] = EOS_ID
    return ids.masked_fill(mask == 0, PAD_ID), mask


@pytest.fixture
def text_batch():
    return make_text_batch


@pytest.fixture(scope="session")
def tiny_model():
    from mplug_pretrain.models.presets import build_model
    torch.manual_seed(0)
    return build_model("tiny")
