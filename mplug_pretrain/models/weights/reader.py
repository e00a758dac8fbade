"""A module's weights <-> one ``.safetensors`` file, with tied (shared) tensors stored once.

safetensors refuses two names for one storage (a decoder's ``lm_head.weight`` tied to its token
embedding). The file keeps the first name of each storage group; loading copies that tensor into
the module, and the tie (the same ``nn.Parameter`` under both names) fills the alias.
"""
from __future__ import annotations

import torch
from torch import nn


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
    from safetensors.torch import save_file
    aliases = tied_aliases(module)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items() if k not in aliases}
    metadata = {"format": "pt"}
    if aliases:
        metadata["tied"] = ",".join(f"{alias}={kept}" for alias, kept in sorted(aliases.items()))
    save_file(state, path, metadata=metadata)


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
