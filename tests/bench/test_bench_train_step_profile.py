"""`mplug bench train-step --profile` (bench/train_step_profile.py): the bucket rules on real op and kernel
names, the buckets of a real torch.profiler run of a step whose parts are known, the op / cast / block counts
against what the tiny preset's shape says, and the CLI end to end (slow)."""
import json

import pytest
import torch
import torch.nn.functional as F

from mplug_pretrain.bench.step_profile import BUCKETS, bucket_of, profile_step
from mplug_pretrain.bench.step_proxies import StepOpCounter, count_step_ops
from mplug_pretrain.models.presets import build_model
from tests.helpers import run_mplug
from tests.models.test_mplug import pretrain_batch


@pytest.mark.parametrize(("name", "enclosing", "bucket"), [
    ("aten::addmm", (), "matmul"),
    ("aten::bmm", ("autograd::engine::evaluate_function: BmmBackward0",), "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", (), "matmul"),
    ("cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", (), "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", (), "attention"),
    ("aten::bmm", ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math"), "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", (), "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", (), "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", (), "attention"),
    ("aten::_foreach_mul_", (), "optimizer"),
    ("aten::copy_", ("optimizer.step (DeepSpeed engine.step + momentum update)",), "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", (), "optimizer"),
    ("aten::mm", ("Optimizer.step#AdamW.step",), "optimizer"),
    ("aten::add", (), "elementwise"),
    ("aten::_to_copy", (), "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>", (), "elementwise"),
])
def test_bucket_rules(name, enclosing, bucket):
    assert bucket_of(name, enclosing) == bucket


def test_profiled_step_puts_each_known_part_in_its_bucket():
    torch.manual_seed(0)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    q = torch.randn(2, 4, 64, 32)
    weight = torch.nn.Parameter(torch.randn(256, 256))
    optimizer = torch.optim.AdamW([weight], foreach=False)
    weight.grad = torch.randn(256, 256)

    def step():
        for _ in range(4):
            a @ b
        F.scaled_dot_product_attention(q, q, q)
        for _ in range(20):
            (a * 2).exp_()
        optimizer.step()

    row = profile_step(step, "cpu")
    for name in BUCKETS:
        assert row[f"{name}_seconds"] >= 0
    for name in ("matmul", "attention", "elementwise", "optimizer"):
        assert row[f"{name}_seconds"] > 0, name
    assert sum(row[f"{name}_seconds"] for name in BUCKETS) == pytest.approx(row["wall_seconds"], rel=1e-6)
    assert sum(row[f"{name}_share"] for name in BUCKETS) == pytest.approx(1.0, rel=1e-6)


def test_cast_counter_tells_parameter_casts_from_other_casts():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4)
    out = torch.empty(3, 4, dtype=torch.bfloat16)
    with StepOpCounter({weight.untyped_storage().data_ptr()}) as counter:
        weight.to(torch.bfloat16)  # a parameter cast
        x.to(torch.bfloat16)  # a cast of an activation
        out.copy_(x)  # a cast by copy
        x.to(torch.float32)  # same dtype: no cast, no op
        x + 1
    assert (counter.parameter_casts, counter.casts) == (1, 2)
    assert counter.ops == 4


def test_forward_ops_and_block_calls_follow_the_tiny_shape(text_batch):
    torch.manual_seed(0)
    model = build_model("tiny").eval()
    batch = pretrain_batch(text_batch, b=4, t=10)
    counts = count_step_ops(model, lambda: model(batch)["loss"].backward())
    c = model.config
    # online + momentum towers; text encoder: caption, momentum, MLM-masked, PrefixLM prefix; fusion: ITM, MLM,
    # PrefixLM passes; the decoder once
    assert counts["block_calls"] == {"vit_block": 2 * c.vision.layers, "text_layer": 4 * c.text.encoder_layers,
                                     "fusion_layer": 3 * c.fusion.layers, "decoder_layer": c.decoder.layers}
    assert counts["ops_per_step"] > sum(counts["ops_per_block"][k] * n for k, n in counts["block_calls"].items())
    assert 10 < counts["ops_per_block"]["vit_block"] < counts["ops_per_block"]["decoder_layer"]
    assert counts["casts_per_step"] >= 0 and counts["parameter_casts_per_step"] == 0  # fp32: autocast casts none


@pytest.mark.slow  # a single-rank DeepSpeed engine, fp32 and bf16 (bf16 is slow on this CPU), + host syncs: ~3 min
def test_profile_cli_writes_buckets_counts_and_host_syncs(tmp_path, demo_shards):
    out = tmp_path / "profile.json"
    proc = run_mplug(["bench", "train-step", "--profile", "--quick", "--out", str(out)])  # its own process group
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    fp32, bf16 = result["rows"]
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    for row in (fp32, bf16):
        assert row["engine_zero_stage"] == 0 and row["zero_stage"] == 2  # one rank: ZeRO-2 runs as ZeRO-0
        assert sum(row[f"{b}_seconds"] for b in BUCKETS) == pytest.approx(row["wall_seconds"], rel=1e-6)
        assert row["matmul_seconds"] > 0 and row["optimizer_seconds"] > 0
    assert bf16["parameter_casts_per_step"] > 0 == fp32["parameter_casts_per_step"]  # autocast casts weights
    assert bf16["casts_per_step"] > fp32["casts_per_step"]
    syncs = result["host_syncs"]
    assert syncs["ours_outside_log_steps_max"] <= 1
    assert max(n for n, logged in zip(syncs["ours_per_step"], syncs["log_step"]) if logged) <= 2
