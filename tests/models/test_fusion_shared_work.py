"""Work one step shares: the image states' cross-attention keys/values computed once for every fusion pass,
ITM fused by row index, PrefixLM's causal self-attention through ``is_causal``. Each equals the separate
computation (each pass projecting its own copy of the image states, the dense causal bias) in fp32."""
from __future__ import annotations

import pytest
import torch

from mplug_pretrain.models.decoders.bert import BertDecoder
from mplug_pretrain.models.fusion import AllConnectedFusion, SkipConnectedFusion, TwoStreamFusion
from mplug_pretrain.models.heads.prefix_lm import prefix_lm_loss
from mplug_pretrain.models.model_config import DecoderConfig
from mplug_pretrain.models.presets import build_model

W, H, FFN = 32, 4, 64


def _fusion_inputs(b=3, m=5, t=4):
    g = torch.Generator().manual_seed(0)
    image, text = torch.randn(b, m, W, generator=g), torch.randn(2 * b, t, W, generator=g)
    image_mask = torch.ones(b, m, dtype=torch.long)
    image_mask[2, -2:] = 0
    text_mask = torch.ones(2 * b, t, dtype=torch.long)
    text_mask[1, -1] = 0
    rows = torch.tensor([0, 2, 1, 1, 0, 2])  # text row i fuses with image row rows[i]
    return image, image_mask, text, text_mask, rows


def _grads(module, outputs):
    module.zero_grad()
    sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outputs).backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make", [
    lambda: SkipConnectedFusion(W, H, FFN, 5, 2, "code", 0.0),  # CCXCX: two layers share keys/values
    lambda: SkipConnectedFusion(W, H, FFN, 3, 6, "code", 0.0),  # CCC: no connected layer at all
    lambda: AllConnectedFusion(W, H, FFN, 2, 0.0),
    lambda: TwoStreamFusion(W, H, FFN, 2, 0.0),
])
def test_fusing_by_row_index_with_shared_keys_equals_fusing_copied_rows(make):
    torch.manual_seed(0)
    fusion = make()
    image, image_mask, text, text_mask, rows = _fusion_inputs()
    expected = fusion(image[rows], image_mask[rows], text, text_mask)
    expected_grads = _grads(fusion, expected)
    shared = fusion.image_keys_values(image)
    got = fusion(image, image_mask, text, text_mask, image_rows=rows, image_kv=shared)
    assert [o.shape for o in got] == [o.shape for o in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    got_grads = _grads(fusion, got)
    assert got_grads.keys() == expected_grads.keys()
    for name in expected_grads:
        torch.testing.assert_close(got_grads[name], expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_keys_values_are_shared_by_the_layers_before_the_first_connected_layer():
    fusion = SkipConnectedFusion(W, H, FFN, 6, 3, "code", 0.0)  # CCCXCC
    image = torch.randn(2, 5, W)
    kv = fusion.image_keys_values(image)
    assert len(kv) == 3 and all(k.shape == v.shape == (2, H, 5, W // H) for k, v in kv)
    assert AllConnectedFusion(W, H, FFN, 2, 0.0).image_keys_values(image) == []


@pytest.mark.parametrize("training", [False, True])
def test_right_padded_decoder_is_causal_without_a_bias_and_equal_on_real_tokens(training):
    torch.manual_seed(0)
    decoder = BertDecoder(DecoderConfig(layers=2, heads=H, ffn_dim=FFN, dropout=0.1), vocab_size=50, width=W)
    decoder.train(training)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (3, 6), generator=g)
    mask = (torch.arange(6)[None] < torch.tensor([[6], [4], [2]])).long()  # right padded
    memory, memory_mask = torch.randn(3, 5, W, generator=g), torch.ones(3, 5, dtype=torch.long)
    results = []
    for right_padded in (False, True):
        torch.manual_seed(2)  # the same dropout draws
        logits = decoder(ids, mask, memory, memory_mask, right_padded=right_padded).logits
        loss = prefix_lm_loss(logits, ids, mask)
        decoder.zero_grad()
        loss.backward()
        results.append((logits, loss, {n: p.grad.clone() for n, p in decoder.named_parameters()}))
    (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) = results
    real = mask.bool()
    torch.testing.assert_close(logits_b[real], logits_a[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-6, msg=name)
    if not training:  # padding queries may now attend to earlier padding: their outputs differ (and are unused)
        assert not torch.allclose(logits_b[~real], logits_a[~real])


def _pretrain_batch(text_batch, b=6, t=12):
    ids, mask = text_batch(b, t, seed=3)
    image = torch.randn(b, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    return {"image": image, "input_ids": ids, "attention_mask": mask, "image_id": torch.tensor([0, 0, 1, 2, 3, 4])}


@pytest.mark.parametrize("training", [False, True])
def test_pretraining_losses_and_gradients_equal_the_separate_passes(text_batch, training):
    """The tiny preset's four losses and every gradient, fp32, shared work on and off (1e-5)."""
    torch.manual_seed(0)
    model = build_model("tiny").train(training)
    model.defer_enqueue = True  # the queues stay as they are, so both runs see the same ITC state
    batch = _pretrain_batch(text_batch)
    runs = []
    for fast in (True, False):
        model.fast_fusion_paths = fast
        model.zero_grad()
        torch.manual_seed(1)  # the same negatives, masks, prefix splits and dropout draws
        out = model(batch)
        out["loss"].backward()
        runs.append(({k: v.detach() for k, v in out.items()},
                     {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (out_fast, grads_fast), (out_slow, grads_slow) = runs
    for key in out_slow:
        torch.testing.assert_close(out_fast[key], out_slow[key], rtol=1e-5, atol=1e-6, msg=key)
    assert grads_fast.keys() == grads_slow.keys()
    scale = max(g.abs().max() for g in grads_slow.values())
    for name in grads_slow:
        torch.testing.assert_close(grads_fast[name], grads_slow[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
