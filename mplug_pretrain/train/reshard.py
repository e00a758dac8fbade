"""Resume a checkpoint on another number of ranks and/or ZeRO stage (model and optimizer side; the trainer
state, data positions and RNG are the loop's): read a tag written by any of our layouts into the full fp32
training state by parameter name (``read_consolidated``), then put it into an engine built for the new world
size and stage (``apply_consolidated``). DeepSpeed's ``load_checkpoint`` only loads partitions written by the
same world size and stage; ``load_resharded`` is the call for every other case.

Layouts (DeepSpeed 0.19 with our engine: parameters always fp32, torch AdamW, never BF16_Optimizer)::

  ZeRO-0, any number of ranks (nothing partitioned)
    mp_rank_00_model_states.pt   "module": the whole state dict (its trainable parameters are the masters);
        "optimizer": torch AdamW's state dict, indexed 0..N-1 over the param groups in order. The file does
        not name the indices: they follow ``model.param_groups()`` (empty groups dropped), so the model of
        the tag's model_config.json is built on the meta device (no memory) to name them.
  ZeRO-1/2, W ranks
    mp_rank_00_model_states.pt   "module" as above (replicated); "param_shapes"[g]: name -> shape of group
        g's parameters in flat order; "buffer_names"; "shared_params" (alias -> name)
    zero_pp_rank_R_mp_rank_00_optim_states.pt   "optimizer_state_dict":
        "single_partition_of_fp32_groups"[g]   rank R's slice of group g's flat fp32 vector, its share of
                                               the tail padding ("group_paddings"[g]) cut off
        "base_optimizer_state"                 AdamW's state over those slices: "step", and exp_avg /
                                               exp_avg_sq of the whole slice length P (padding included)
        "param_alignment_paddings"[g][k]       zeros after parameter k (0 unless zero_optimization's
                                               parameter_alignment is set)
    group g's flat vector:  p0 | pad0 | p1 | pad1 | ... | p_last | tail padding to a multiple of 2·W;
    rank R holds its elements [R·P, (R+1)·P).
  ZeRO-3, W ranks
    zero_pp_rank_R_mp_rank_00_model_states.pt   "module": the buffers (parameters are empty placeholders);
        "param_shapes"[s] per sub-group; "frozen_param_shapes", "frozen_param_fragments": rank R's
        partition of each frozen parameter (the momentum encoders)
    zero_pp_rank_R_mp_rank_00_optim_states.pt   "fp32_flat_groups"[s]: rank R's partitions of sub-group s's
        parameters back to back; "optimizer_state_dict": AdamW's state over those flat tensors
    a parameter of n elements has W partitions of ceil(n / W), the last zero-padded: rank R holds its
    elements [R·ceil(n/W), (R+1)·ceil(n/W)).

Memory: every rank reads the consolidated state itself (no broadcast, no collective), so while loading each
rank holds on the host three fp32 copies of the trainable parameters (weights, exp_avg, exp_avg_sq: 12 bytes
per parameter) and one of the frozen parameters and buffers (4 bytes per element), plus the one checkpoint
file it is reading (the rank files are read one at a time). The base preset (345 M trainable, 153 M frozen)
takes ~4.7 GB per rank, ~38 GB on a node of 8 ranks at once; it is freed when ``load_resharded`` returns.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from mplug_pretrain.errors import DataError
from mplug_pretrain.models.weights.reader import read_torch_file, tied_aliases
from mplug_pretrain.train.checkpoint import (
    MODEL_CONFIG,
    CheckpointError,
    deepspeed_safe_globals,
    refuse_unsafe_tag,
)

MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO 0-2: the module (replicated)
MOMENTS = ("exp_avg", "exp_avg_sq")


def optim_states_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def zero3_model_states_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


@dataclass
class ConsolidatedState:
    """The full training state by parameter name, as one process holds it (fp32 tensors on the CPU, in their
    parameter's shape)."""
    masters: dict[str, torch.Tensor]  # trainable parameters: the optimizer's fp32 masters
    exp_avg: dict[str, torch.Tensor]  # AdamW's moments; a name absent had no state (ZeRO-0: never a gradient)
    exp_avg_sq: dict[str, torch.Tensor]
    step: int  # AdamW's step count (the same for every parameter)
    module_state: dict[str, torch.Tensor]  # the rest: frozen parameters (momentum encoders), buffers (queues)
    zero_stage: int = 0  # the layout read
    world_size: int = 1  # the ranks that wrote it

    @property
    def moments(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


# ----------------------------------------------------------------------------------------------- read
@torch.no_grad()  # the files' fp32 partitions were saved with requires_grad; copies of them need none
def read_consolidated(tag_dir: str, saved_world_size: int, model=None) -> ConsolidatedState:
    """The full fp32 state of the tag ``tag_dir`` written by ``saved_world_size`` ranks, whatever its layout
    (module docstring). ``model``, for the ZeRO-0 layout only: a module of the architecture that wrote it (its
    ``param_groups`` name the optimizer's indices); by default MPLUG built on the meta device from the tag's
    model_config.json. Files are read weights-only with DeepSpeed's allow-list; a file that does not hold
    what the layout needs is a CheckpointError naming it."""
    first_name = optim_states_file(0)
    if os.path.isfile(os.path.join(tag_dir, first_name)):
        first = _load(tag_dir, first_name)
        with _reading(tag_dir, first_name):
            stage = int(first["optimizer_state_dict"]["zero_stage"])
        if stage in (1, 2):
            return _read_zero12(tag_dir, saved_world_size, first, stage)
        if stage == 3:
            return _read_zero3(tag_dir, saved_world_size, first)
        raise CheckpointError(f"{os.path.join(tag_dir, first_name)}: ZeRO stage {stage}, not a layout this "
                              "reader knows (0-3)")
    if os.path.isfile(os.path.join(tag_dir, MODEL_STATES)):
        return _read_zero0(tag_dir, saved_world_size, model)
    raise CheckpointError(f"{tag_dir}: neither {MODEL_STATES} nor {first_name}: not a DeepSpeed tag")


@contextlib.contextmanager
def _reading(tag_dir: str, name: str):
    """A file that does not hold what its layout promises: CheckpointError naming it."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as err:
        if isinstance(err, DataError):  # CheckpointError, UnsafeFileError: they name their file already
            raise
        raise CheckpointError(f"{os.path.join(tag_dir, name)}: not the layout the tag's other files describe "
                              f"({type(err).__name__}: {err}); damaged, or written by another DeepSpeed "
                              "version") from err


def _load(tag_dir: str, name: str) -> dict:
    path = os.path.join(tag_dir, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; the tag is incomplete, or was written by fewer ranks than "
                              "its marker says")
    try:
        return read_torch_file(path, deepspeed_safe_globals())  # UnsafeFileError: an object off the list
    except DataError:
        raise
    except (OSError, EOFError, RuntimeError) as err:
        raise CheckpointError(f"{path}: cannot be read (truncated or damaged?): {err}") from err


def _rank_optimizer_states(tag_dir: str, world: int, first: dict):
    """(rank, file name, its "optimizer_state_dict") for each rank in turn, rank 0's file already read as
    ``first``; the caller drops each before the next is read (one rank's file in memory at a time)."""
    for rank in range(world):
        name = optim_states_file(rank)
        saved, first = first if rank == 0 else _load(tag_dir, name), None
        with _reading(tag_dir, name):
            sd = saved["optimizer_state_dict"]
            _check_world(tag_dir, name, sd["partition_count"], world)
        saved = None
        yield rank, name, sd
        sd = None


def _check_world(tag_dir: str, name: str, partition_count, world: int) -> None:
    counts = set(partition_count) if isinstance(partition_count, (list, tuple)) else {partition_count}
    if counts != {world}:
        raise CheckpointError(f"{os.path.join(tag_dir, name)}: partitioned over {sorted(counts)} rank(s), "
                              f"but the tag is said to be written by {world}")
    extra = os.path.join(tag_dir, optim_states_file(world))
    if os.path.exists(extra):
        raise CheckpointError(f"{extra}: a partition beyond the {world} rank(s) that wrote the tag (a tag "
                              "mixed from two runs?)")


def _take_step(steps: set, opt_state: dict) -> None:
    if "step" in opt_state:
        steps.add(int(opt_state["step"]))


def _one_step(tag_dir: str, steps: set) -> int:
    if len(steps) > 1:
        raise CheckpointError(f"{tag_dir}: the optimizer's parameters are at different AdamW steps "
                              f"{sorted(steps)}; a partitioned optimizer keeps one step per group, so this "
                              "state cannot be resharded")
    return steps.pop() if steps else 0


def _zeros(shapes: dict) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(tuple(shape), dtype=torch.float32) for name, shape in shapes.items()}


def _read_zero0(tag_dir: str, world: int, model) -> ConsolidatedState:
    saved = _load(tag_dir, MODEL_STATES)
    with _reading(tag_dir, MODEL_STATES):
        module, optimizer = saved["module"], saved["optimizer"]
        groups, aliases = _named_param_groups(tag_dir, model)
        saved_groups = [(g.get("name"), len(g["params"])) for g in optimizer["param_groups"]]
        if saved_groups != [(name, len(names)) for name, names in groups]:
            raise CheckpointError(f"{os.path.join(tag_dir, MODEL_STATES)}: its optimizer's groups "
                                  f"{saved_groups} are not those of the model that names them "
                                  f"{[(name, len(names)) for name, names in groups]}")
        masters, moments, steps = {}, {key: {} for key in MOMENTS}, set()
        for saved_group, (_, names) in zip(optimizer["param_groups"], groups, strict=True):
            for index, name in zip(saved_group["params"], names, strict=True):
                masters[name] = module[name].float().clone()
                state = optimizer["state"].get(index, {})
                _take_step(steps, state)
                for key in MOMENTS:
                    if key in state:
                        moments[key][name] = state[key].float().reshape(masters[name].shape).clone()
        rest = {k: v.clone() for k, v in module.items() if k not in masters and aliases.get(k) not in masters}
    return ConsolidatedState(masters, moments["exp_avg"], moments["exp_avg_sq"], _one_step(tag_dir, steps),
                             rest, zero_stage=0, world_size=world)


def _named_param_groups(tag_dir: str, model) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """[(group name, [parameter names])] in the optimizer's order, and the module's tied aliases
    (alias -> name)."""
    if model is None:
        from mplug_pretrain.models.folder.config_io import read_model_config
        from mplug_pretrain.models.mplug import MPLUG
        path = os.path.join(tag_dir, MODEL_CONFIG)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing; the optimizer state of a ZeRO-0 tag is named through "
                                  "the model that wrote it")
        with torch.device("meta"):  # names and grouping only: no memory, no initialisation
            model = MPLUG(read_model_config(path))
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [g for g in model.param_groups(weight_decay=0.0, lr_vision=0.0, lr_rest=0.0) if g["params"]]
    return [(g.get("name"), [names[id(p)] for p in g["params"]]) for g in groups], tied_aliases(model)


def _read_zero12(tag_dir: str, world: int, first: dict, stage: int) -> ConsolidatedState:
    saved = _load(tag_dir, MODEL_STATES)
    with _reading(tag_dir, MODEL_STATES):
        group_shapes = [dict(shapes) for shapes in saved["param_shapes"]]
        aliases = dict(saved.get("shared_params") or {})
        trainable = {name for shapes in group_shapes for name in shapes}
        rest = {k: v.clone() for k, v in saved["module"].items()
                if k not in trainable and aliases.get(k) not in trainable}
        del saved
    all_shapes = {k: v for shapes in group_shapes for k, v in shapes.items()}
    masters, moments = _zeros(all_shapes), {key: _zeros(all_shapes) for key in MOMENTS}
    filled, steps = dict.fromkeys(masters, 0), set()
    for rank, name, sd in _rank_optimizer_states(tag_dir, world, first):
        with _reading(tag_dir, name):
            base, flats = sd["base_optimizer_state"], sd["single_partition_of_fp32_groups"]
            paddings = sd.get("param_alignment_paddings") or [[0] * len(shapes) for shapes in group_shapes]
            recorded = sd.get("param_slice_mappings")
            if len(flats) != len(group_shapes):
                raise CheckpointError(f"{os.path.join(tag_dir, name)}: {len(flats)} parameter groups, "
                                      f"{MODEL_STATES} describes {len(group_shapes)}")
            for g, (shapes, flat) in enumerate(zip(group_shapes, flats, strict=True)):
                state = base["state"].get(base["param_groups"][g]["params"][0], {})
                _take_step(steps, state)
                size = flat.numel() + int(sd["group_paddings"][g])  # this rank's slice, padding included
                for key in MOMENTS:
                    if key in state and state[key].numel() != size:
                        raise CheckpointError(f"{os.path.join(tag_dir, name)}: group {g}'s {key} has "
                                              f"{state[key].numel()} elements, its partition {size}")
                start, offset = rank * size, 0
                for (param, shape), pad in zip(shapes.items(), paddings[g], strict=True):
                    numel = math.prod(shape)
                    lo, hi = max(offset, start), min(offset + numel, start + size)
                    if lo < hi:  # the part of this parameter that rank R holds
                        if recorded:
                            _check_fragment(tag_dir, name, recorded[g].get(param), param, lo - start, hi - lo)
                        dst, src = slice(lo - offset, hi - offset), slice(lo - start, hi - start)
                        masters[param].view(-1)[dst] = flat[src]
                        for key in MOMENTS:
                            if key in state:
                                moments[key][param].view(-1)[dst] = state[key][src]
                        filled[param] += hi - lo
                    offset += numel + int(pad)
        del sd
    _check_filled(tag_dir, filled, masters)
    return ConsolidatedState(masters, moments["exp_avg"], moments["exp_avg_sq"], _one_step(tag_dir, steps),
                             rest, zero_stage=stage, world_size=world)


def _check_fragment(tag_dir: str, name: str, address, param: str, start: int, numel: int) -> None:
    """The fragment the shapes place is the one DeepSpeed recorded (``param_slice_mappings``)."""
    if address is None or (int(address.start), int(address.numel)) != (start, numel):
        raise CheckpointError(f"{os.path.join(tag_dir, name)}: {param} is recorded at {address}, its shapes "
                              f"place it at start={start} numel={numel}: a flat layout this reader does not "
                              "know")


def _check_filled(tag_dir: str, filled: dict[str, int], full: dict[str, torch.Tensor]) -> None:
    wrong = [name for name, count in filled.items() if count != full[name].numel()]
    if wrong:
        raise CheckpointError(f"{tag_dir}: the partitions do not cover {wrong[0]} exactly "
                              f"({filled[wrong[0]]} of {full[wrong[0]].numel()} elements"
                              f"{', ...' if len(wrong) > 1 else ''}): a rank's file from another run or "
                              "world size?")


def _read_zero3(tag_dir: str, world: int, first: dict) -> ConsolidatedState:
    model_name = zero3_model_states_file(0)
    model_states = _load(tag_dir, model_name)
    with _reading(tag_dir, model_name):
        sub_group_shapes = [dict(shapes) for shapes in model_states["param_shapes"]]
        frozen_shapes = dict(model_states.get("frozen_param_shapes") or {})
        module = model_states["module"]
        rest = {k: module[k].clone() for k in model_states["buffer_names"] if k in module}
    all_shapes = {k: v for shapes in sub_group_shapes for k, v in shapes.items()}
    masters, moments = _zeros(all_shapes), {key: _zeros(all_shapes) for key in MOMENTS}
    frozen = _zeros(frozen_shapes)
    filled, steps = dict.fromkeys([*masters, *frozen], 0), set()
    for rank, name, sd in _rank_optimizer_states(tag_dir, world, first):
        with _reading(tag_dir, name):
            optimizer, flats = sd["optimizer_state_dict"], sd["fp32_flat_groups"]
            # sub-groups are handed to AdamW group by group, in order: state index s is sub-group s
            indices = [index for group in optimizer["param_groups"] for index in group["params"]]
            if not len(flats) == len(indices) == len(sub_group_shapes):
                raise CheckpointError(f"{os.path.join(tag_dir, name)}: {len(flats)} flat groups, "
                                      f"{len(indices)} optimizer entries, {model_name} describes "
                                      f"{len(sub_group_shapes)}")
            for shapes, flat, index in zip(sub_group_shapes, flats, indices, strict=True):
                state = optimizer["state"].get(index, {})
                _take_step(steps, state)
                sources = [(masters, flat)] + [(moments[key], state[key]) for key in MOMENTS if key in state]
                used = _scatter_partitions(shapes, rank, world, sources, filled)
                if used != flat.numel():
                    raise CheckpointError(f"{os.path.join(tag_dir, name)}: a flat group of {flat.numel()} "
                                          f"elements holds partitions of {used}")
        del sd
        if frozen_shapes:
            model_name = zero3_model_states_file(rank)
            model_states = model_states if rank == 0 else _load(tag_dir, model_name)
            with _reading(tag_dir, model_name):
                fragments = model_states["frozen_param_fragments"]
                flat = torch.cat([fragments[k].reshape(-1).float() for k in frozen_shapes])
                _scatter_partitions(frozen_shapes, rank, world, [(frozen, flat)], filled)
        model_states = None
    _check_filled(tag_dir, filled, {**masters, **frozen})
    return ConsolidatedState(masters, moments["exp_avg"], moments["exp_avg_sq"], _one_step(tag_dir, steps),
                             {**frozen, **rest}, zero_stage=3, world_size=world)


def _scatter_partitions(shapes: dict, rank: int, world: int, sources, filled: dict) -> int:
    """Copy rank ``rank``'s ZeRO-3 partitions (ceil(n / world) elements per parameter, back to back in each
    source flat tensor) into the full tensors; -> the flat length they take."""
    offset = 0
    for param, shape in shapes.items():
        numel = math.prod(shape)
        size = math.ceil(numel / world)
        take = max(0, min(size, numel - rank * size))  # the last partitions hold padding
        for full, flat in sources:
            full[param].view(-1)[rank * size:rank * size + take] = flat[offset:offset + take]
        filled[param] += take
        offset += size
    return offset


# ----------------------------------------------------------------------------------------------- apply
def apply_consolidated(engine, state: ConsolidatedState, zero_stage: int) -> None:
    """Put ``state`` into ``engine`` (just built by ``build_engine`` for this world size; ``zero_stage``: the
    stage it runs): the module's weights (under ZeRO-3 this rank's partitions, and the full copy of persistent
    ones), frozen parameters and buffers, and the optimizer's fp32 masters, exp_avg, exp_avg_sq and step:
    ZeRO-0 in ``optimizer.state[param]``, ZeRO 1-2 this rank's fragments of each flat group (``_hp_mapping``),
    ZeRO-3 this rank's partitions. Each rank copies what it holds: no collective."""
    module = engine.module
    params = dict(module.named_parameters())
    trainable = {name: p for name, p in params.items() if p.requires_grad}
    frozen = {name: p for name, p in params.items() if not p.requires_grad}
    buffers = _persistent_buffers(module)
    _check_names(state, trainable, frozen, buffers, zero_stage)
    with torch.no_grad():
        for name, buf in buffers.items():
            buf.copy_(state.module_state[name])
        if zero_stage == 3:
            _apply_zero3(engine.optimizer, state, trainable, frozen)
            return
        for name, p in params.items():  # replicated: every rank's module holds the full fp32 values
            p.data.copy_(state.masters[name] if name in trainable else state.module_state[name])
        if zero_stage == 0:
            _apply_zero0(engine.optimizer, state, trainable)
        else:
            _apply_zero12(engine.optimizer, state, trainable)


def _persistent_buffers(module) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def _shape(p) -> tuple:
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


def _check_names(state: ConsolidatedState, trainable: dict, frozen: dict, buffers: dict,
                 zero_stage: int) -> None:
    problems = []
    missing, extra = sorted(set(trainable) - set(state.masters)), sorted(set(state.masters) - set(trainable))
    if missing or extra:
        problems.append(f"trainable parameters it lacks {missing[:3]}, it has but are not trainable here "
                        f"{extra[:3]}")
    absent = sorted((set(frozen) | set(buffers)) - set(state.module_state))
    if absent:
        problems.append(f"frozen parameters / buffers it lacks {absent[:3]}")
    wrong, rest = [], state.module_state
    for here, saved in ((trainable, state.masters), (frozen, rest), (buffers, rest)):
        wrong += [(name, tuple(saved[name].shape), _shape(t)) for name, t in here.items()
                  if name in saved and tuple(saved[name].shape) != _shape(t)]
    if wrong:
        problems.append(f"shapes (saved, here) differ {wrong[:3]}")
    if problems:
        raise CheckpointError(f"the ZeRO-{state.zero_stage} state of {state.world_size} rank(s) does not fit "
                              f"this model (ZeRO-{zero_stage}): {'; '.join(problems)}")


def _step_tensor(step: int, group: dict, like: torch.Tensor) -> torch.Tensor:
    """AdamW's "step" as torch keeps it: a float32 scalar, on the parameter's device for the fused or
    capturable implementations, else on the CPU."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=like.device if on_device else "cpu")


def _apply_zero0(optimizer, state: ConsolidatedState, trainable: dict) -> None:
    names = {id(p): name for name, p in trainable.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            optimizer.state.pop(p, None)
            if name in state.exp_avg:  # a parameter that never had AdamW state stays without
                moments = {key: state.moments[key][name].to(p.device, copy=True) for key in MOMENTS}
                optimizer.state[p] = {"step": _step_tensor(state.step, group, p), **moments}


def _apply_zero12(zero, state: ConsolidatedState, trainable: dict) -> None:
    """Each group's AdamW state is one flat tensor over this rank's partition; the masters and moments go into
    this rank's fragment of each parameter through its ``_hp_mapping`` (deepspeed.utils safe_set_full_*:
    each rank copies the part it holds)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    for i, group in enumerate(zero.optimizer.param_groups):
        flat = group["params"][0]
        zero.optimizer.state[flat] = {"step": _step_tensor(state.step, group, flat),
                                      **{key: torch.zeros_like(flat) for key in MOMENTS}}  # padding: zero
        for lp in zero.bit16_groups[i]:
            if lp._hp_mapping is not None:  # its fragments: views of the new state tensors
                lp._hp_mapping.set_optim_state_fragment(flat, zero.optimizer.state[flat])
    for name, p in trainable.items():
        safe_set_full_fp32_param(p, state.masters[name])
        for key in MOMENTS:
            if name in state.moments[key]:
                safe_set_full_optimizer_state(p, state.moments[key][name], key)


def _apply_zero3(zero, state: ConsolidatedState, trainable: dict, frozen: dict) -> None:
    """This rank's partition of every parameter into its ``ds_tensor`` (and the full copy of a persistent
    one), and of every trainable one into the fp32 flat sub-groups and their AdamW state
    (safe_set_local_*)."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state
    for s, flat in enumerate(zero.fp32_partitioned_groups_flat):
        group = zero.optimizer.param_groups[zero.sub_group_to_group_id[s]]
        zero.optimizer.state[flat] = {"step": _step_tensor(state.step, group, flat),
                                      **{key: torch.zeros_like(flat) for key in MOMENTS}}
    for name, p in {**trainable, **frozen}.items():
        full = state.masters[name] if name in trainable else state.module_state[name]
        local = local_partition(full, p)
        p.ds_tensor.data.copy_(local)
        if p.data.numel() == p.ds_numel:  # persistent: its full copy is the one the forward uses
            p.data.copy_(full.reshape(p.data.shape))
        if name in trainable:
            safe_set_local_fp32_param(p, local)
            for key in MOMENTS:
                if name in state.moments[key]:
                    safe_set_local_optimizer_state(p, local_partition(state.moments[key][name], p), key)


def local_partition(full: torch.Tensor, param) -> torch.Tensor:
    """This rank's ZeRO-3 partition of ``full`` for ``param``: elements [R·P, (R+1)·P) of the flattened
    tensor, zero-padded past its end (P: the partition's size, ceil(numel / world))."""
    import deepspeed.comm as dist
    size = param.ds_tensor.numel()
    rank = dist.get_rank(group=param.ds_process_group)
    flat = full.reshape(-1)
    out = torch.zeros(size, dtype=torch.float32)
    take = max(0, min(size, flat.numel() - rank * size))
    out[:take] = flat[rank * size:rank * size + take]
    return out.to(param.ds_tensor.device)


# ----------------------------------------------------------------------------------------------- load
def load_resharded(engine, ckpt_dir: str, tag: str, rank: int, zero_stage: int,
                   saved_world_size: int) -> None:
    """Load ``ckpt_dir/tag``, written by ``saved_world_size`` ranks at any ZeRO stage, into ``engine`` (this
    run's world size, at ``zero_stage``) on rank ``rank``: every file of the tag is scanned first
    (``refuse_unsafe_tag``), then read (``read_consolidated``) and applied (``apply_consolidated``). Errors
    are CheckpointError naming the file or tag (UnsafeFileError: a file that would need arbitrary
    unpickling)."""
    tag_dir = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"{tag_dir}: no such folder")
    refuse_unsafe_tag(tag_dir)
    state = read_consolidated(tag_dir, saved_world_size)
    try:
        apply_consolidated(engine, state, zero_stage)
    except CheckpointError as err:
        raise CheckpointError(f"{tag_dir} (rank {rank}): {err}") from err
