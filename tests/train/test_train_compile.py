"""`run.compile: true` compiles the model (DeepSpeed engine.compile -> torch.compile). The model must trace
and give the eager losses and gradients: checked on the tiny preset with the aot_eager backend (dynamo
graph capture + AOT autograd, eager kernels; inductor's C++ code generation takes ~8 minutes on 2 cores)."""
import pytest
import torch

from mplug_pretrain.models.mplug import MPLUG
from mplug_pretrain.models.presets import get_preset_config

pytestmark = pytest.mark.slow  # ~100 s of tracing on the shared 2-core machine


def _losses_and_grads(model, batch):
    torch.manual_seed(1)  # MLM masking, PrefixLM split and ITM negatives draw from the global RNG
    out = model(batch, alpha=0.4)
    out["loss"].backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in out.items()}, grads


def test_compiled_model_gives_eager_losses_and_gradients():
    torch.manual_seed(0)
    model = MPLUG(get_preset_config("tiny")).eval()  # eval: no dropout, queues left untouched between calls
    ids = torch.cat([torch.full((4, 1), 101), torch.randint(1000, 2000, (4, 7)), torch.full((4, 1), 102)], dim=1)
    batch = {"image": torch.randn(4, 3, 64, 64), "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    eager_out, eager_grads = _losses_and_grads(model, batch)
    compiled_out, compiled_grads = _losses_and_grads(torch.compile(model, backend="aot_eager"), batch)
    for key, value in eager_out.items():
        torch.testing.assert_close(compiled_out[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert compiled_grads.keys() == eager_grads.keys()
    for key, value in eager_grads.items():
        torch.testing.assert_close(compiled_grads[key], value, rtol=1e-4, atol=1e-6, msg=key)
