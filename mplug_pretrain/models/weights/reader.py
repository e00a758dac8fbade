"""Reading weight files without running code from them, and a module's weights <-> one ``.safetensors`` file.

Torch files (``torch.save`` pickles: DeepSpeed checkpoints, official checkpoints) are read with
``torch.load(weights_only=True)`` plus an explicit allow-list of the few classes a caller expects
(``read_torch_file``). A file that needs any other object is refused with its path and the object's name,
found by reading the pickle's opcodes (``torch.serialization.get_unsafe_globals_in_checkpoint``), never by
unpickling it. ``weights_only_loads`` extends the same rule to code we do not own (DeepSpeed passes
``weights_only=False`` itself): inside it every ``torch.load`` is forced to ``weights_only=True``.

safetensors refuses two names for one storage (a decoder's ``lm_head.weight`` tied to its token
embedding). The file keeps the first name of each storage group; loading copies that tensor into
the module, and the tie (the same ``nn.Parameter`` under both names) fills the alias.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from mplug_pretrain.errors import DataError
from mplug_pretrain.utils.atomic_files import atomic_write

_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch's own switch: weights_only=True even where a caller passed False
_FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class UnsafeFileError(DataError):
    """A file would need arbitrary unpickling (objects outside the allow-list) to load: refused, nothing run."""


def _name(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def forbidden_objects(path: str, allowed: Sequence = ()) -> list[str]:
    """Names of the classes / functions the pickle in ``path`` refers to that neither torch's weights-only
    loader nor ``allowed`` accept; read from the pickle's opcodes, nothing is unpickled."""
    with torch.serialization.safe_globals(list(allowed)):
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))


def refuse_unsafe(path: str, allowed: Sequence = ()) -> None:
    """Raise UnsafeFileError naming ``path`` and the objects it would need, when it needs any. A file that is not
    a torch zip checkpoint (the legacy format) cannot be scanned: the weights-only loader alone guards it."""
    try:
        bad = forbidden_objects(path, allowed)
    except (ValueError, RuntimeError):  # legacy format, TorchScript, or not a torch file at all
        return
    if bad:
        raise UnsafeFileError(
            f"{path}: refused: loading it would create {', '.join(bad)}, which only arbitrary unpickling can do "
            "(a file from someone else can run code that way); only tensors and plain containers"
            f"{' (and ' + ', '.join(_name(a) for a in allowed) + ')' if allowed else ''} are accepted")


@contextlib.contextmanager
def weights_only_loads(allowed: Sequence = ()) -> Iterator[None]:
    """Every ``torch.load`` inside the block runs with ``weights_only=True`` (whatever its caller passed) and
    accepts ``allowed`` besides torch's own safe types. An object outside that list raises
    ``pickle.UnpicklingError`` before it is created."""
    saved = {k: os.environ.get(k) for k in (_FORCE, _FORCE_NOT)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_FORCE_NOT, None)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_torch_file(path: str, allowed: Sequence = (), map_location="cpu"):
    """``torch.load(path, weights_only=True)`` accepting ``allowed`` too; UnsafeFileError names the file and
    the object when anything else is needed."""
    refuse_unsafe(path, allowed)
    try:
        with weights_only_loads(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # a legacy-format file, or an object the opcode scan cannot see
        raise UnsafeFileError(f"{path}: refused: {refused_object(err)}") from err


def refused_object(err: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, in one line ("it needs builtins.exec ...")."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    if found:
        return f"loading it would create {found.group(1)}, which only arbitrary unpickling can do"
    return next((line.strip() for line in str(err).splitlines() if "Unsupported" in line),
                str(err).splitlines()[0] if str(err) else "weights-only load failed")


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """alias name -> kept name, for every state-dict entry that shares its tensor with an earlier one."""
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first_name:
            aliases[name] = first_name[key]
        else:
            first_name[key] = name
    return aliases


def save_weights(module: nn.Module, path: str) -> None:
    """All state-dict tensors (CPU, contiguous) to ``path``, each tied group once."""
    from safetensors.torch import save
    aliases = tied_aliases(module)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items() if k not in aliases}
    metadata = {"format": "pt"}
    if aliases:
        metadata["tied"] = ",".join(f"{alias}={kept}" for alias, kept in sorted(aliases.items()))
    # safetensors' save_file creates the file with mode 0600 (a temporary file renamed); our atomic writer
    # creates it like open() does, so the umask applies (0644 under 022: colleagues can read the model)
    with atomic_write(path, "wb") as f:
        f.write(save(state, metadata=metadata))


def load_weights_into(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict load of ``state`` (as read from a ``save_weights`` file, maybe edited) into ``module``.

    Names missing from ``state`` are allowed only where ``module`` ties them to a name that is present;
    anything else missing or unexpected raises, naming ``source`` and the keys."""
    aliases = tied_aliases(module)
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k in aliases and aliases[k] in state)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{source}: weights do not match the model: missing {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}, unexpected {result.unexpected_keys[:5]}"
                           f"{' ...' if len(result.unexpected_keys) > 5 else ''}")
