"""Analytic pretraining FLOPs (train/flops.py) against torch's FlopCounterMode on a real forward + backward."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import get_preset_config
from mplug_pretrain.train.flops import TextShapes, mfu, peak_flops, pretrain_flops_per_sample

CAPTION, BATCH = 7, 4


def _pinned_config(**changes):
    """Tiny preset whose data-dependent shapes are fixed: every caption token masked for MLM (p just below 1,
    above float32 rand()'s largest value), the PrefixLM prefix is all but the last caption token."""
    cfg = get_preset_config("tiny")
    cfg.heads.mlm_probability = 0.99999995
    cfg.heads.prefix_min_tokens = 10 ** 6
    for section, values in changes.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def _batch():
    ids = torch.cat([torch.full((BATCH, 1), 101), torch.randint(1000, 2000, (BATCH, CAPTION)),
                     torch.full((BATCH, 1), 102)], dim=1)
    return {"image": torch.randn(BATCH, 3, 64, 64), "input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("changes", [
    {},
    {"vision": {"width": 96, "heads": 2}, "fusion": {"layers": 3, "stride": 2}},  # projection 96 -> 128; C C X
    {"fusion": {"type": "all_connected"}},
    {"fusion": {"type": "two_stream"}},
])
def test_analytic_flops_equal_flop_counter_forward_backward(changes):
    torch.manual_seed(0)
    cfg = _pinned_config(**changes)
    model = MPLUG(cfg).train()
    with torch.no_grad():
        model(_batch(), alpha=0.4)  # fills BATCH queue columns
    batch = _batch()
    # the math kernel runs attention as matmuls the counter sees; the CPU fused kernel has no formula
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(batch, alpha=0.4)["loss"].backward()
    measured = counter.get_total_flops() / BATCH
    # executed shapes: the MLM head on every position, the drawn prefix and target padded to the text length
    shapes = TextShapes(text_len=CAPTION + 2, prefix_len=CAPTION + 2, target_len=CAPTION + 2, mlm_tokens=CAPTION + 2)
    analytic = pretrain_flops_per_sample(cfg, shapes, BATCH, queue=BATCH).total
    # exact before the sync-free forward (issue 23); since, the counter sees 0.22 % more (3.1 of 1,396 MFLOP per
    # sample at this size) that the analytic count does not yet place: a known gap, far below a missing part
    # (the MLM-at-every-position change alone was 15 %)
    assert analytic == pytest.approx(measured, rel=5e-3)


def test_backward_is_twice_forward_for_trained_parts_and_zero_for_momentum():
    cfg = get_preset_config("base")
    count = pretrain_flops_per_sample(cfg, TextShapes.typical(30), batch_size=64)
    assert count.parts["momentum"] > 0
    trained = count.total - count.parts["momentum"]
    assert count.backward < 2 * count.forward
    assert count.backward == pytest.approx(2 * (count.forward - count.parts["momentum"]), rel=0.01)
    assert trained > 0


def test_base_preset_order_of_magnitude_matches_6n_rule():
    """Independent rough check: 6 x (ViT-B params) x 257 tokens is the ViT's share; the whole step is a few times it."""
    cfg = get_preset_config("base")
    vit_params = 12 * 12 * 768 ** 2
    vit_6n = 6 * vit_params * 257
    count = pretrain_flops_per_sample(cfg, TextShapes.typical(30), batch_size=64)
    assert 0.8 * vit_6n < count.parts["vision"] < 1.3 * vit_6n
    assert 2 * vit_6n < count.total < 6 * vit_6n


def test_peak_table_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Unknown GPU") is None
    assert peak_flops(None) is None and peak_flops(None, cpu_peak=1e12) == 1e12
    assert mfu(1e9, 100.0, 1e12) == pytest.approx(0.1)
    assert mfu(1e9, 100.0, None) is None
