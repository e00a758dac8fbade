"""The tensors of a TorchScript archive (OpenAI CLIP's released ``ViT-B-16.pt``), read as data: nothing in it runs.

``torch.jit.load`` would compile the archive's ``code/`` and call each object's ``__setstate__``, which can create
or overwrite any file (``torch.from_file``) and so run code later. Here the zip is read directly:

    <root>/data.pkl     the module tree, pickled: ``__torch__.<Class>`` objects built from a dict of attributes
    <root>/data/<key>   the raw bytes of storage ``key`` (persistent id ``("storage", torch.<T>Storage, key, ...)``)

``data.pkl`` is unpickled by ``_DataOnlyUnpickler``: a ``__torch__.*`` class becomes an inert placeholder that
only keeps the state given to it (its own ``__setstate__``; the archive's is never looked up), tensors are rebuilt
from the storages here, and every other global is refused (UnsafeFileError names it). The tensors are then
collected by attribute path (``visual.conv1.weight``): the names ``torch.jit.load(...).state_dict()`` gives.
"""
from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict

import torch

from mplug_pretrain.errors import DataError
from mplug_pretrain.models.weights.reader import UnsafeFileError

# the storage classes a data.pkl names, by their legacy names (torch.FloatStorage ...) -> element dtype
STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


def is_torchscript_archive(path: str) -> bool:
    """A zip with a ``constants.pkl`` record or a ``code/`` folder (what ``torch.jit.save`` writes)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return any(name.split("/", 1)[-1] == "constants.pkl" or name.split("/", 1)[-1].startswith("code/")
                   for name in zf.namelist())


class ScriptObject:
    """A ``__torch__.*`` object of the archive, inert: ``state`` is what the pickle gave it (a module's attribute
    dict), ``args`` what it was constructed with. Subclassed once per archive class name (``script_class``)."""

    script_name = ""

    def __init__(self, *args):
        self.args = args
        self.state = None

    def __setstate__(self, state):  # ours, not the archive's: keep the state, run nothing
        self.state = state


def _identity(value, *_):
    return value


def _as_list(value, *_):
    return list(value)


class _Rebuilt:
    """``torch._utils._rebuild_tensor_v2`` without its hooks: a view of an already-read storage."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, storage, offset, size, stride, *_ignored):
        if not isinstance(storage, torch.Tensor):
            raise DataError(f"{self.path}: data.pkl: a tensor without a storage record")
        try:
            return torch.empty(0, dtype=storage.dtype).set_(storage.untyped_storage(), offset, tuple(size),
                                                            tuple(stride))
        except (RuntimeError, TypeError) as err:
            raise DataError(f"{self.path}: data.pkl: a tensor of size {size} does not fit its storage "
                            f"({err})") from None


class _DataOnlyUnpickler(pickle.Unpickler):
    """See the module docstring. ``records(key) -> bytes`` reads storage ``key``."""

    def __init__(self, data: bytes, path: str, records):
        super().__init__(io.BytesIO(data))
        self.path = path
        self.records = records
        self.classes: dict[str, type] = {}
        self.storages: dict[str, torch.Tensor] = {}

    def find_class(self, module: str, name: str):
        if module == "__torch__" or module.startswith("__torch__."):
            qualified = f"{module}.{name}"
            if qualified not in self.classes:
                self.classes[qualified] = type(name, (ScriptObject,), {"script_name": qualified})
            return self.classes[qualified]
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]  # only read back by persistent_load
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuilt(self.path)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) == ("torch.jit._pickle", "restore_type_tag"):
            return _identity
        if module == "torch.jit._pickle" and name in ("build_intlist", "build_doublelist", "build_boollist",
                                                      "build_tensorlist"):
            return _as_list
        raise UnsafeFileError(f"{self.path}: refused: its data.pkl names {module}.{name}; a TorchScript archive is "
                              "read as data (modules, tensors and plain values only), nothing in it is run")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)
                and isinstance(pid[2], str)):
            raise DataError(f"{self.path}: data.pkl: unexpected persistent id {str(pid)[:80]}")
        dtype, key = pid[1], pid[2]
        if key not in self.storages:
            raw = bytearray(self.records(key))
            itemsize = torch.empty(0, dtype=dtype).element_size()
            if len(raw) % itemsize:
                raise DataError(f"{self.path}: data/{key}: {len(raw)} bytes is not a whole number of {dtype}")
            self.storages[key] = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return self.storages[key]


def _archive_root(zf: zipfile.ZipFile, path: str) -> str:
    roots = [name[: -len("data.pkl")] for name in zf.namelist() if name.endswith("data.pkl")
             and name.count("/") == 1]
    if len(roots) != 1:
        raise DataError(f"{path}: not a TorchScript archive with one <root>/data.pkl (found {len(roots)})")
    return roots[0]


def _collect(obj, prefix: str, out: dict[str, torch.Tensor], seen: set[int]) -> None:
    """Every tensor reachable from ``obj``, by dotted attribute path; shared or cyclic objects once."""
    if id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor):
        out.setdefault(prefix, obj.detach())  # detached: no hook the pickle may have attached comes along
        return
    seen.add(id(obj))
    if isinstance(obj, ScriptObject):
        _collect(obj.state, prefix, out, seen)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str):
                _collect(value, f"{prefix}.{key}" if prefix else key, out, seen)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _collect(value, f"{prefix}.{index}" if prefix else str(index), out, seen)


def read_torchscript_state_dict(path: str) -> dict[str, torch.Tensor]:
    """``{attribute path: tensor}`` of a TorchScript archive, read as data (see the module docstring)."""
    try:
        with zipfile.ZipFile(path) as zf:
            root = _archive_root(zf, path)
            names = set(zf.namelist())

            def record(key: str) -> bytes:
                name = f"{root}data/{key}"
                if name not in names:
                    raise DataError(f"{path}: data.pkl names storage {key!r}, the archive has no {name}")
                return _stored(zf, name, path)

            unpickler = _DataOnlyUnpickler(_stored(zf, f"{root}data.pkl", path), path, record)
            try:
                tree = unpickler.load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as err:
                raise DataError(f"{path}: data.pkl cannot be read as data ({type(err).__name__}: {err})") from None
    except zipfile.BadZipFile as err:
        raise DataError(f"{path}: not a readable zip archive ({err})") from None
    state: dict[str, torch.Tensor] = {}
    try:
        _collect(tree, "", state, set())
    except RecursionError:
        raise DataError(f"{path}: data.pkl nests deeper than any module tree") from None
    return state


def _stored(zf: zipfile.ZipFile, name: str, path: str) -> bytes:
    """A record's bytes; torch.jit.save stores records uncompressed, so a compressed one (a possible zip bomb:
    gigabytes from a few kilobytes) is refused before it is inflated."""
    if zf.getinfo(name).compress_type != zipfile.ZIP_STORED:
        raise DataError(f"{path}: {name} is compressed; torch.jit.save writes stored records only")
    return zf.read(name)
