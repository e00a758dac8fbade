"""The precision a forward pass computes in, for training and evaluation alike: under "bf16", torch's bf16
autocast on the device (matmuls in bf16; autocast keeps fp32-sensitive ops such as softmax and normalisation
in fp32); under "fp32", nothing. Which precision a run uses is decided by its caller: training by
``config.resolve_precision``, evaluation by ``eval/common.eval_precision``."""
from __future__ import annotations

import contextlib

import torch


def autocast_context(precision: str, device: torch.device | str):
    """A context manager: bf16 autocast on ``device``'s type for ``precision == "bf16"``, else a no-op."""
    if precision == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
