"""model.grad_checkpointing's three modes: off, whole layer and selective give the same losses and gradients;
selective recomputes the element-wise ops of a layer but none of its matrix products (counted in backward)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.layers.checkpointing import run_layer
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.models.towers.text import BertLayer
from tests.models.test_mplug import pretrain_batch


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the MLM, PrefixLM and ITM draws
    loss = model(batch)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_every_mode_gives_the_losses_and_gradients_of_no_checkpointing(text_batch):
    torch.manual_seed(0)
    model = build_model("tiny").eval()  # eval: no dropout, no queue writes between the runs
    batch = pretrain_batch(text_batch, b=4, t=10)
    model.set_grad_checkpointing(False)
    loss, grads = _loss_and_grads(model, batch)
    for mode in (True, "selective"):
        model.set_grad_checkpointing(mode)
        assert model.text_encoder.grad_checkpointing == mode and model.fusion.grad_checkpointing == mode
        other_loss, other_grads = _loss_and_grads(model, batch)
        torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=1e-6)
        assert other_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")


def _backward_ops(mode, dropout: float = 0.1) -> Counter:
    torch.manual_seed(0)
    layer = BertLayer(32, 4, 64, dropout, cross_attention=True).train()
    x = torch.randn(2, 6, 32, requires_grad=True)
    source = torch.randn(2, 5, 32)
    out = run_layer(layer, x, None, source, None, enabled=mode)
    with _OpCounter() as counter:
        out.sum().backward()
    return counter.calls


def test_selective_recomputes_the_element_wise_ops_and_no_matrix_product():
    matmuls = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu")
    off, whole, selective = (_backward_ops(mode) for mode in (False, True, "selective"))
    for op in matmuls:
        assert selective[op] == off[op], op  # the backward's own products only
    assert sum(whole[op] for op in matmuls) > sum(off[op] for op in matmuls)  # whole layer: the forward's again
    assert selective["native_layer_norm"] > off["native_layer_norm"] == 0  # recomputed by selective only
    assert selective["native_layer_norm"] == whole["native_layer_norm"]


@pytest.mark.parametrize("value", ["partial", 2])
def test_an_unknown_mode_is_refused_with_the_field_named(value):
    model = build_model("tiny")
    with pytest.raises(ConfigError, match="model.grad_checkpointing"):
        model.set_grad_checkpointing(value)


def test_the_config_accepts_selective_and_refuses_other_words():
    from mplug_pretrain.config import load_config
    assert load_config(None, ["model.grad_checkpointing=selective"]).model.grad_checkpointing == "selective"
    assert load_config(None, ["model.grad_checkpointing=true"]).model.grad_checkpointing is True
    with pytest.raises(ConfigError, match="model.grad_checkpointing"):
        load_config(None, ["model.grad_checkpointing=partial"])
