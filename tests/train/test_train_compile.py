"""``run.compile``: every transformer block compiled on its own (train/block_compile.py). Checked on the tiny
preset: dynamo captures each block whole (fullgraph: a graph break is an error; no break counted), the model
gives the eager losses and gradients (fp32), inductor's code for one block equals eager, and ``mplug pretrain``
with run.compile=true trains on the demo shards. The whole-model checks use the aot_eager backend (graph
capture + AOT autograd, eager kernels): inductor's C++ code generation for every block takes minutes on 2 cores."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from mplug_pretrain.config import load_config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import get_preset_config
from mplug_pretrain.models.towers.text import BertLayer
from mplug_pretrain.train.block_compile import compile_blocks, is_compiled, pad_text, transformer_blocks
from tests.helpers import read_log, run_mplug, tiny_pretrain_args


def _losses_and_grads(model, batch):
    torch.manual_seed(1)  # MLM masking, PrefixLM split and ITM negatives draw from the global RNG
    out = model(batch, alpha=0.4)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in out.items()}, grads


def test_pad_text_pads_ids_and_mask_to_the_next_multiple_only():
    ids = torch.tensor([[101, 7, 102], [101, 102, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids > 0).long(), "image": torch.zeros(2, 3)}
    padded = pad_text(batch, multiple=8)
    assert padded["input_ids"].shape == padded["attention_mask"].shape == (2, 8)
    assert torch.equal(padded["input_ids"][:, :3], ids) and not padded["input_ids"][:, 3:].any()
    assert torch.equal(padded["attention_mask"].sum(1), torch.tensor([3, 2]))
    assert padded["image"] is batch["image"]
    assert pad_text(padded, multiple=8) is padded  # already a multiple
    assert pad_text({"image": batch["image"]}) == {"image": batch["image"]}


def test_every_vit_block_and_bert_layer_is_compiled_momentum_copies_included():
    model = MPLUG(get_preset_config("tiny"))
    cfg = model.config
    expected = 2 * cfg.vision.layers + 2 * cfg.text.encoder_layers + cfg.fusion.layers + cfg.decoder.layers
    assert compile_blocks(model, backend="eager") == expected == len(transformer_blocks(model))
    assert all(is_compiled(block) for _, block in transformer_blocks(model))
    assert not is_compiled(model) and not is_compiled(model.text_encoder.embeddings)
    assert set(model.state_dict()) == set(MPLUG(get_preset_config("tiny")).state_dict())  # names unchanged


def test_compile_settings_are_checked_with_the_field_named():
    with pytest.raises(ConfigError, match="run.compile_backend"):
        load_config(None, ["run.compile=true", "run.compile_backend=no_such_backend"])
    with pytest.raises(ConfigError, match="zero_stage=3"):
        load_config(None, ["run.compile=true", "distributed.zero_stage=3"])
    assert load_config(None, ["run.compile=true", "run.compile_backend=aot_eager"]).run.compile_backend == "aot_eager"


@pytest.mark.slow  # ~60 s of tracing on the shared 2-core machine
def test_compiled_blocks_have_no_graph_break_and_give_eager_losses_and_gradients():
    torch.manual_seed(0)
    model = MPLUG(get_preset_config("tiny")).eval()  # eval: no dropout, queues left untouched between calls
    ids = torch.cat([torch.full((4, 1), 101), torch.randint(1000, 2000, (4, 7)), torch.full((4, 1), 102)], dim=1)
    batch = pad_text({"image": torch.randn(4, 3, 64, 64), "input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert batch["input_ids"].shape[1] == 16
    eager_out, eager_grads = _losses_and_grads(model, batch)
    backend = CompileCounterWithBackend("aot_eager")
    counters.clear()
    compile_blocks(model, backend=backend)
    compiled_out, compiled_grads = _losses_and_grads(model, batch)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph per distinct block call (kind, rows, length, grad mode), each a whole block: no break splits one
    assert 0 < backend.frame_count == counters["stats"]["unique_graphs"] <= 16
    for key, value in eager_out.items():
        torch.testing.assert_close(compiled_out[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert compiled_grads.keys() == eager_grads.keys()
    for key, value in eager_grads.items():
        torch.testing.assert_close(compiled_grads[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow  # inductor's C++ code generation for one layer: ~40 s on 2 cores
def test_inductor_compiled_fusion_layer_equals_eager():
    torch.manual_seed(0)
    layer = BertLayer(32, 4, 64, 0.0, cross_attention=True)
    x, source = torch.randn(2, 8, 32), torch.randn(2, 5, 32)
    bias = torch.zeros(2, 1, 1, 8).masked_fill_(torch.arange(8) >= 6, torch.finfo(torch.float32).min)

    def run():
        inputs = x.clone().requires_grad_()
        out = layer(inputs, bias, source, None)
        (out * torch.linspace(-1, 1, 32)).sum().backward()
        grads = [inputs.grad, *(p.grad.clone() for p in layer.parameters())]
        layer.zero_grad(set_to_none=True)
        return out.detach(), grads

    eager = run()
    counters.clear()
    layer.compile(backend="inductor", fullgraph=True, dynamic=False)
    compiled = run()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled[1], eager[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~2 min: tracing every block kind at two text lengths
def test_pretrain_cli_trains_with_compiled_blocks(tmp_path, demo_shards):
    args = tiny_pretrain_args(tmp_path, demo_shards, "compiled", steps=3, extra=[
        "run.compile=true", "run.compile_backend=aot_eager", "run.log_every=1", "data.num_workers=0"])
    proc = run_mplug(["pretrain", *args], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [r for r in read_log(tmp_path / "compiled") if "step" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in records)
    assert "compiled" in proc.stdout + proc.stderr and "graph break" not in (proc.stdout + proc.stderr).lower()
