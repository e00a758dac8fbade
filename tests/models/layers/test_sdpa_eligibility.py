"""Which fused SDPA kernels each attention call of a base-size bf16 pretraining step could use on a GPU.

Recorded on CPU: torch.backends.cuda.can_use_{flash,efficient,cudnn}_attention answer False for every CPU
tensor (they check the device first), so the conditions they check are computed here from each call's
arguments, following torch's aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (sm80+ GPU assumed):
  flash:     q, k, v fp16/bf16; no attn_mask; equal head dims <= 256; is_causal only with T == S;
             last dim contiguous.
  efficient: fp16/bf16/fp32; head dim % 8 == 0 (half); a mask in q's dtype (or bool); last dim contiguous;
             storage offsets 16-byte aligned.
  cudnn:     fp16/bf16; head dim % 8 == 0 and <= 128; dropout a multiple of 1/16; S_k != 1; last dim contiguous
             (masks of any float dtype accepted).
The step runs in eval mode (on CPU, training attention dropout runs outside SDPA); each call is judged with
the dropout its module trains with. The base preset at its real widths, heads, image (257 tokens) and text
(30 tokens) sizes, with one layer per stack where the count does not change the calls' kinds.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mplug_pretrain.models.layers.attention import MultiHeadAttention
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.models.towers.vision import ViTAttention

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Call:
    site: str
    dtype: torch.dtype
    query: tuple
    key: tuple
    mask: str  # "none" or the mask's dtype and shape
    is_causal: bool
    dropout: float
    flash: bool
    efficient: bool
    cudnn: bool


def _eligibility(q, k, v, mask, is_causal, dropout):
    d = q.shape[-1]
    same_d = k.shape[-1] == d == v.shape[-1]
    last_contiguous = all(t.stride(-1) == 1 for t in (q, k, v))
    aligned = all(t.storage_offset() * t.element_size() % 16 == 0 for t in (q, k, v))
    flash = (q.dtype in HALF and mask is None and same_d and d <= 256 and last_contiguous
             and (not is_causal or q.shape[-2] == k.shape[-2]))
    efficient = (q.dtype in HALF + (torch.float32,) and same_d and d % (8 if q.dtype in HALF else 4) == 0
                 and (mask is None or mask.dtype in (torch.bool, q.dtype)) and last_contiguous and aligned)
    cudnn = (q.dtype in HALF and same_d and d % 8 == 0 and d <= 128 and dropout * 16 == int(dropout * 16)
             and k.shape[-2] != 1 and last_contiguous)
    return flash, efficient, cudnn


class SDPARecorder(TorchFunctionMode):
    def __init__(self, model):
        super().__init__()
        self.calls: list[Call] = []
        self.site, self.dropout = "", 0.0
        for name, module in model.named_modules():
            if isinstance(module, (MultiHeadAttention, ViTAttention)):
                module.register_forward_pre_hook(self._enter(name, getattr(module, "dropout", 0.0)))

    def _enter(self, name, dropout):
        def hook(module, args):
            self.site, self.dropout = _site(name), dropout
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            is_causal = kwargs.get("is_causal", False)
            flags = _eligibility(q, k, v, mask, is_causal, self.dropout)
            described = "none" if mask is None else f"{str(mask.dtype)[6:]} {list(mask.shape)}"
            self.calls.append(Call(self.site, q.dtype, tuple(q.shape), tuple(k.shape), described, is_causal,
                                   self.dropout, *flags))
        return func(*args, **kwargs)


def _site(name: str) -> str:
    """'fusion.layers.3.attn' -> 'fusion.attn' (one row per kind of call)."""
    return ".".join(part for part in name.split(".") if not part.isdigit())


pytestmark = pytest.mark.slow  # the base widths: about 25 s of CPU


@pytest.fixture(scope="module")
def base_step_calls():
    torch.manual_seed(0)
    model = build_model("base", vision__layers=1, text__encoder_layers=1, decoder__layers=1).eval()
    b, t = 2, 30
    lengths = torch.tensor([30, 14])
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    ids = torch.randint(1000, 2000, (b, t)).masked_fill(mask == 0, 0)
    ids[:, 0], ids[torch.arange(b), lengths - 1] = 101, 102
    batch = {"image": torch.randn(b, 3, 256, 256), "input_ids": ids, "attention_mask": mask,
             "image_id": torch.arange(b)}
    recorder = SDPARecorder(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), recorder:
        model(batch)
    for call in sorted(set(recorder.calls), key=lambda c: (c.site, c.query)):
        print(call)  # the table in the report: pytest -s
    return recorder.calls


def test_every_call_runs_in_bf16_with_masks_in_bf16(base_step_calls):
    assert base_step_calls and all(c.dtype == torch.bfloat16 for c in base_step_calls)
    assert all(c.mask == "none" or c.mask.startswith("bfloat16") for c in base_step_calls)
    assert all(c.efficient for c in base_step_calls)  # the fallback that takes a key-padding bias


def test_vision_and_decoder_self_attention_reach_flash(base_step_calls):
    by_site = {c.site: c for c in base_step_calls}
    vit = by_site["image_encoder.vit.transformer.resblocks.attn"]
    assert vit.query == (2, 12, 257, 64) and vit.flash and vit.cudnn
    decoder = [c for c in base_step_calls if c.site == "decoder.layers.attn"]
    assert decoder and all(c.is_causal and c.mask == "none" and c.flash for c in decoder)
    assert not any(c.cudnn for c in decoder)  # training dropout 0.1 is not a multiple of 1/16


def test_bert_side_calls_carry_a_key_padding_bias_not_a_dense_one(base_step_calls):
    """Text, fusion and decoder cross-attention: a [B, 1, 1, S] key-padding bias (no [B, 1, T, S] one)."""
    masked = [c for c in base_step_calls if c.mask != "none"]
    assert masked and all(c.mask.endswith(f"[{c.query[0]}, 1, 1, {c.key[2]}]") for c in masked)
    assert set(Counter(c.site for c in masked)) == {"text_encoder.layers.attn", "text_encoder_m.layers.attn",
                                                    "fusion.layers.attn", "decoder.layers.cross_attn"}
    to_image = [c for c in base_step_calls if c.site == "fusion.layers.cross_attn"]
    assert to_image and all(c.mask == "none" and c.flash for c in to_image)  # the image states have no padding
