"""utils/precision.py: the one precision context, and the rule each caller picks its precision by (training:
the resolved ``distributed.precision`` on this rank's device; evaluation: bf16 only on a GPU)."""
import torch

from mplug_pretrain.config import config_from_dict
from mplug_pretrain.eval.common import eval_autocast
from mplug_pretrain.train.engine import train_autocast
from mplug_pretrain.utils import process_group
from mplug_pretrain.utils.precision import autocast_context


def matmul_dtype(device="cpu") -> torch.dtype:
    a = torch.ones(4, 4, device=device)
    return (a @ a).dtype


def test_bf16_autocasts_matmuls_and_fp32_leaves_them():
    with autocast_context("bf16", torch.device("cpu")):
        assert matmul_dtype() == torch.bfloat16
    with autocast_context("fp32", "cpu"):
        assert matmul_dtype() == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # left as found


def test_training_follows_the_run_precision_on_its_device():
    device = process_group.device()
    with train_autocast(config_from_dict({"distributed": {"precision": "bf16"}}, check_paths=False)):
        assert matmul_dtype(device) == torch.bfloat16
    with train_autocast(config_from_dict({"distributed": {"precision": "fp32"}}, check_paths=False)):
        assert matmul_dtype(device) == torch.float32


def test_evaluation_on_a_cpu_stays_fp32_even_for_a_bf16_run():
    model = torch.nn.Linear(4, 4)
    with eval_autocast(config_from_dict({"distributed": {"precision": "bf16"}}, check_paths=False), model):
        assert model(torch.ones(2, 4)).dtype == torch.float32
