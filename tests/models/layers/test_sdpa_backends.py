"""The SDPA backend priority: torch's own order off CUDA, flash first on CUDA with MPLUG_SDPA_PREFER_CUDNN=0,
and attention under a priority list computes the same thing."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from mplug_pretrain.models.layers.attention import CUDNN_FIRST, FLASH_FIRST, attend, sdpa_backends


def test_cpu_keeps_torchs_order(monkeypatch):
    monkeypatch.setenv("MPLUG_SDPA_PREFER_CUDNN", "1")
    assert sdpa_backends(torch.device("cpu")) is None


def test_switched_off_puts_flash_first_on_cuda(monkeypatch):
    monkeypatch.setenv("MPLUG_SDPA_PREFER_CUDNN", "0")
    assert sdpa_backends(torch.device("cuda", 0)) == FLASH_FIRST


def test_attention_under_the_cudnn_first_list_is_unchanged():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    with sdpa_kernel(CUDNN_FIRST, set_priority=True):
        prioritised = attend(q, k, v, is_causal=True)
    torch.testing.assert_close(prioritised, F.scaled_dot_product_attention(q, k, v, is_causal=True))
