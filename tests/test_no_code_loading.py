"""Issue 37, item 1: no file the package reads can run code. A scan of the package's source (``ast``, every call
and attribute, also inside functions) finds no ``torch.jit.load``, no ``torch.load`` without a literal
``weights_only=True``, no ``torch.hub.load`` / ``allow_pickle=True`` / marshal / shelve / dill, and the pickle
module's loaders only in the allow-listed readers, whose unpicklers restrict ``find_class`` (tested beside them:
tests/models/weights/test_torchscript_archive.py, tests/data/writers for the refs pickle)."""
import ast
import pathlib

import mplug_pretrain

PACKAGE_ROOT = pathlib.Path(mplug_pretrain.__file__).parent
# the only modules that may touch pickle's loaders: each subclasses pickle.Unpickler with a find_class that
# creates nothing but inert placeholders, tensors and builtin containers
PICKLE_READERS = {"models/weights/torchscript_archive.py", "data/writers/grounding.py"}
PICKLE_LOADERS = {"load", "loads", "Unpickler", "_Unpickler"}
NEVER = {("jit", "load"), ("hub", "load"), ("marshal", "loads"), ("marshal", "load"), ("shelve", "open"),
         ("dill", "load"), ("dill", "loads"), ("cloudpickle", "load"), ("cloudpickle", "loads")}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def unsafe_loads(source: str, relative: str) -> list[str]:
    """'<file>:<line>: <what>' for each way of running a file's code found in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{relative}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            owner = name.rpartition(".")[0].rpartition(".")[2]
            if (owner, node.attr) in NEVER:
                found.append(f"{where}: {name}")
            if owner == "pickle" and node.attr in PICKLE_LOADERS and relative not in PICKLE_READERS:
                found.append(f"{where}: {name} outside the allow-listed readers")
        elif isinstance(node, ast.ImportFrom) and node.module in ("pickle", "marshal", "shelve", "dill", "cloudpickle"):
            if any(alias.name in PICKLE_LOADERS | {"open"} for alias in node.names):
                found.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            if name in ("torch.load", "torch.serialization.load", "serialization.load"):
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where}: {name} without weights_only=True")
            allow = keywords.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{where}: {name}(allow_pickle=...)")
    return found


def test_the_scan_finds_each_kind():
    bad = ("import torch, pickle, numpy\nfrom pickle import loads\ntorch.jit.load('a')\ntorch.load('a')\n"
           "torch.load('a', weights_only=False)\npickle.load(open('a'))\nclass U(pickle.Unpickler): pass\n"
           "numpy.load('a', allow_pickle=True)\ntorch.hub.load('x', 'y')\n")
    found = unsafe_loads(bad, "models/anything.py")
    assert len(found) == 8, found
    assert unsafe_loads("import torch\ntorch.load('a', map_location='cpu', weights_only=True)\n", "x.py") == []
    assert unsafe_loads("import pickle\npickle.Unpickler\n", "data/writers/grounding.py") == []


def test_no_code_loading_in_the_package():
    found = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        found += unsafe_loads(path.read_text(), path.relative_to(PACKAGE_ROOT).as_posix())
    assert found == []
