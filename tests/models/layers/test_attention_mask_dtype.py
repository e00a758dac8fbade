"""Attention masks in the queries' dtype under bf16 autocast (SDPA's memory-efficient kernel needs it on a
GPU; an fp32 mask would also be cast per layer, to -inf) and all-masked rows finite in bf16."""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mplug_pretrain.models.layers.attention import MultiHeadAttention, cast_bias, key_padding_bias
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import get_preset_config


class RecordSDPA(TorchFunctionMode):
    """Records (query dtype, mask dtype) of every scaled_dot_product_attention call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append((args[0].dtype, None if mask is None else mask.dtype))
        return func(*args, **kwargs)


def _padded_batch(b=3, t=9):
    ids = torch.randint(1000, 2000, (b, t))
    ids[:, 0] = 101
    mask = torch.ones(b, t, dtype=torch.long)
    for row, length in enumerate((t, t - 3, 4)[:b]):  # right padded, different lengths
        ids[row, length - 1] = 102
        ids[row, length:] = 0
        mask[row, length:] = 0
    return {"image": torch.randn(b, 3, 64, 64), "input_ids": ids, "attention_mask": mask}


def test_every_attention_mask_has_the_query_dtype_under_bf16_autocast():
    torch.manual_seed(0)
    model = MPLUG(get_preset_config("tiny")).train()
    batch = _padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU training attention (dropout outside SDPA) in bf16
        assert torch.isfinite(model(batch, alpha=0.4)["loss"].float())
    for module in model.modules():  # attention dropout off: every attention goes through SDPA, as on a GPU
        if isinstance(module, MultiHeadAttention):
            module.dropout = 0.0
    recorder = RecordSDPA()
    with torch.autocast("cpu", dtype=torch.bfloat16), recorder:
        out = model(batch, alpha=0.4)
    assert torch.isfinite(out["loss"].float())
    masked = [(q, m) for q, m in recorder.calls if m is not None]
    assert len(masked) >= 4, recorder.calls  # text encoder, fusion, decoder self/cross attention
    assert all(q == torch.bfloat16 for q, _ in recorder.calls)
    assert all(m == q for q, m in masked), masked


def test_biases_are_built_in_the_autocast_dtype_not_cast_per_layer():
    from mplug_pretrain.models.decoders.bert import causal_bias
    mask = torch.tensor([[1, 1, 0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key_padding_bias(mask).dtype == torch.bfloat16
        assert causal_bias(mask, 3).dtype == torch.bfloat16
    assert key_padding_bias(mask).dtype == torch.float32  # fp32 without autocast, as before


def test_fully_masked_row_is_finite_in_bf16():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2)
    x = torch.randn(2, 4, 16)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(x, bias=key_padding_bias(mask))
    assert torch.isfinite(out.float()).all()
    # a bf16 model called without autocast: the fp32 bias is cast, its -3.4e38 must not become -inf
    bias = key_padding_bias(mask)
    cast = cast_bias(bias, torch.bfloat16)
    assert torch.isfinite(cast).all() and cast.min() == torch.finfo(torch.bfloat16).min
    assert (cast == 0).sum() == (bias == 0).sum()
    out = attn.to(torch.bfloat16)(x.to(torch.bfloat16), bias=bias)
    assert torch.isfinite(out.float()).all()
