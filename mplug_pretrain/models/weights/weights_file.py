"""One tensor file given in a config (a pretrained tower, a BERT folder's weights) -> ``{name: tensor}``, nothing run.

    .safetensors            safetensors (no code possible)
    TorchScript archive     read as data (torchscript_archive.py; OpenAI CLIP's released ``ViT-B-16.pt``)
    any other torch file    ``torch.load(weights_only=True)`` after an opcode scan (reader.read_torch_file)

A file that would need anything else raises UnsafeFileError (a DataError: ``mplug: <file>: refused: ...``, exit 3)
naming ``field``, the config setting that pointed at it.
"""
from __future__ import annotations

import os

import torch

from mplug_pretrain.errors import DataError
from mplug_pretrain.models.weights.reader import UnsafeFileError, read_torch_file
from mplug_pretrain.models.weights.torchscript_archive import (
    is_torchscript_archive,
    read_torchscript_state_dict,
)


def read_weights_file(path: str, field: str):
    """The object the file holds (a state dict, or a dict wrapping one); ``field`` names the setting in errors."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{field}: {path}: no such file")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path)
        if is_torchscript_archive(path):
            return read_torchscript_state_dict(path)
        return read_torch_file(path)
    except UnsafeFileError as err:
        raise UnsafeFileError(f"{field}: {err}") from None
    except (RuntimeError, ValueError, EOFError) as err:  # damaged or not a tensor file at all
        if isinstance(err, DataError):
            raise DataError(f"{field}: {err}") from None
        raise DataError(f"{field}: {path}: cannot be read as a weights file ({str(err).splitlines()[0]})") from None


def tensors_only(obj, path: str) -> dict[str, torch.Tensor]:
    """A state dict unwrapped from ``state_dict`` / ``model`` and ``module.`` prefixes; non-tensors dropped."""
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a state dict, found {type(obj).__name__}")
    return {k.removeprefix("module."): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
