"""models/layers/dropout.py: the CPU keep mask's rate and scaling, its gradient, seeding, and the attention path that
applies it outside SDPA, checked against a softmax written out here and against SDPA itself."""
import math

import pytest
import torch
import torch.nn.functional as F

from mplug_pretrain.models.layers.attention import MultiHeadAttention
from mplug_pretrain.models.layers.dropout import Dropout, attention_with_dropout, dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_scale(p):
    torch.manual_seed(0)
    x = torch.rand(200_000) + 1.0  # no zeros of its own
    out = dropout(x, p)
    kept = out != 0
    n = x.numel()
    # binomial: the kept fraction is within 5 standard deviations of 1 - p
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    torch.testing.assert_close(out[kept], x[kept] / (1 - p))


def test_gradient_is_mask_over_keep_probability():
    torch.manual_seed(1)
    x = torch.randn(64, 32, requires_grad=True)
    out = dropout(x, 0.3)
    out.sum().backward()
    expected = (out.detach() != 0).float() / 0.7
    torch.testing.assert_close(x.grad, expected)


def test_identity_when_off_and_all_zero_at_one():
    x = torch.randn(10, 10)
    assert dropout(x, 0.1, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.count_nonzero(dropout(x, 1.0)) == 0
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(x, 1.5)


def test_seeded_masks_repeat_and_differ_between_calls():
    torch.manual_seed(3)
    first, second = dropout(torch.ones(1000), 0.5), dropout(torch.ones(1000), 0.5)
    torch.manual_seed(3)
    again = dropout(torch.ones(1000), 0.5)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_module_follows_train_and_eval():
    layer = Dropout(0.5)
    x = torch.ones(1000)
    assert torch.equal(layer.eval()(x), x)
    assert torch.count_nonzero(layer.train()(x)) < 1000
    assert layer.state_dict() == {}


def _reference_attention(q, k, v, bias, drop_mask, p):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    probs = torch.exp(scores - scores.max(-1, keepdim=True).values)
    probs = probs / probs.sum(-1, keepdim=True)
    return (probs * drop_mask / (1 - p)) @ v


def test_attention_with_dropout_matches_written_out_softmax():
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    bias = torch.zeros(2, 1, 1, 7)
    bias[0, ..., -2:] = torch.finfo(torch.float32).min
    p = 0.25
    torch.manual_seed(5)
    out = attention_with_dropout(q, k, v, bias, p)
    torch.manual_seed(5)  # the same draws, taken by hand: the mask dropout() makes for a [2, 3, 5, 7] tensor
    mask = (dropout(torch.ones(2, 3, 5, 7), p) != 0).float()
    torch.testing.assert_close(out, _reference_attention(q, k, v, bias, mask, p), atol=1e-5, rtol=1e-5)


def test_attention_module_in_training_equals_sdpa_without_dropout():
    torch.manual_seed(6)
    attn = MultiHeadAttention(32, 4, dropout=0.0).train()
    x, source = torch.randn(3, 5, 32), torch.randn(3, 9, 32)
    bias = torch.zeros(3, 1, 1, 9)
    bias[1, ..., -3:] = torch.finfo(torch.float32).min
    ours = attention_with_dropout(*_qkv(attn, x, source), bias, 0.0)
    sdpa = F.scaled_dot_product_attention(*_qkv(attn, x, source), attn_mask=bias)
    torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)
    # and with dropout on, the module takes this path on CPU: about p of the probabilities are zeroed, so the
    # output differs from SDPA's deterministic one but keeps its scale
    attn.dropout = 0.5
    torch.manual_seed(7)
    out = attn(x, source=source, bias=bias)
    attn.dropout = 0.0
    reference = attn(x, source=source, bias=bias)
    assert not torch.allclose(out, reference)
    assert out.shape == reference.shape


def _qkv(attn, x, source):
    return attn.split_heads(attn.query(x)), *attn.keys_values(source)


def _random_ops(model, batch) -> list[str]:
    """Names of the dropout / random-mask kernels a training forward + backward dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RandomOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if any(word in name for word in ("dropout", "bernoulli", "random_")):
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    with RandomOps() as ops:
        model(batch)["loss"].backward()
    return ops.names


def test_dropout_zero_dispatches_no_dropout_kernel_in_training(text_batch):
    from mplug_pretrain.models.presets import build_model
    ids, mask = text_batch(4, 10)
    batch = {"image": torch.randn(4, 3, 64, 64), "input_ids": ids, "attention_mask": mask,
             "image_id": torch.arange(4)}
    torch.manual_seed(0)
    without = build_model("tiny", text__dropout=0.0, decoder__dropout=0.0).train()
    assert _random_ops(without, batch) == []
    torch.manual_seed(0)
    assert _random_ops(build_model("tiny").train(), batch)  # the default 0.1 does draw masks
