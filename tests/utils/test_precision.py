"""utils/precision.py and the precision policy's pieces that need no DeepSpeed run (the 2-rank bf16 checks are
tests/train/test_bf16_engine.py): evaluation's autocast context, the fp32 islands, the derived DeepSpeed config
(torch_autocast, never DeepSpeed's bf16 parameter cast), the tested DeepSpeed version range."""
import configparser
import os

import pytest
import torch
from torch import nn

from mplug_pretrain.config import config_from_dict, deepspeed_config
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.tasks.evaluation import eval_autocast
from mplug_pretrain.train.engine import DEEPSPEED_VERSIONS, check_deepspeed_version
from mplug_pretrain.utils.precision import FP32LayerNorm, autocast_context, fp32_island, use_fp32_layer_norms
from tests.helpers import REPO_ROOT


def matmul_dtype(device="cpu") -> torch.dtype:
    a = torch.ones(4, 4, device=device)
    return (a @ a).dtype


def test_bf16_autocasts_matmuls_and_fp32_leaves_them():
    with autocast_context("bf16", torch.device("cpu")):
        assert matmul_dtype() == torch.bfloat16
        with fp32_island("cpu"):
            assert matmul_dtype() == torch.float32
    with autocast_context("fp32", "cpu"):
        assert matmul_dtype() == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # left as found


def test_evaluation_on_a_cpu_stays_fp32_even_for_a_bf16_run():
    model = torch.nn.Linear(4, 4)
    with eval_autocast(config_from_dict({"distributed": {"precision": "bf16"}}, check_paths=False), model):
        assert model(torch.ones(2, 4)).dtype == torch.float32


def test_fp32_layer_norm_under_cpu_autocast_matches_an_fp32_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model[1](model[0](x))
    assert plain.dtype == torch.bfloat16  # why the class exists: CPU autocast keeps layer_norm in bf16
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_fp32_layer_norms(model) == 1 and isinstance(model[1], FP32LayerNorm)
    assert model.state_dict().keys() == state.keys()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[0](x)
        out = model[1](hidden)
    assert out.dtype == torch.float32
    reference = torch.nn.functional.layer_norm(hidden.float(), (8,), state["1.weight"], state["1.bias"], 1e-5)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


@pytest.mark.parametrize("accum", [1, 4])
def test_bf16_run_gets_torch_autocast_not_deepspeeds_parameter_cast(accum):
    cfg = config_from_dict({"distributed": {"precision": "bf16"}, "optim": {"grad_accum_steps": accum}},
                           check_paths=False)
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["bf16"] == {"enabled": False}  # the templates' bf16 section is overridden
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    if accum > 1:
        assert ds["data_types"]["grad_accum_dtype"] == "fp32"
    fp32 = deepspeed_config(config_from_dict({"distributed": {"precision": "fp32"}}, check_paths=False), 1)
    assert "torch_autocast" not in fp32 and fp32["bf16"] == {"enabled": False}


def test_deepspeed_version_range_is_the_one_setup_cfg_pins():
    parser = configparser.ConfigParser()
    parser.read(os.path.join(REPO_ROOT, "setup.cfg"))
    requires = [line.strip() for line in parser["options"]["install_requires"].splitlines() if line.strip()]
    assert f"deepspeed{DEEPSPEED_VERSIONS}" in requires
    check_deepspeed_version()  # the installed one is inside
    check_deepspeed_version("0.19.9")
    for outside in ("0.17.6", "0.19.7", "0.20.0"):
        with pytest.raises(ConfigError, match=f"DeepSpeed {outside} is installed.*tested with"):
            check_deepspeed_version(outside)
