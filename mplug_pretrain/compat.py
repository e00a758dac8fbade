"""Import-time compatibility shims, kept in one place.

torchvision wheels on PyPI are CUDA builds; with a CPU-only torch their C++ ops library does not
load and ``import torchvision`` (hence timm / open_clip) fails with
``operator torchvision::nms does not exist``. Defining the two op schemas before torchvision is
imported lets its Python parts (transforms, models) import. Where torchvision's ops library loads (a GPU
machine with a matching torch) nothing is defined: defining the schemas there first would make its own
registration abort the process.
"""
import glob
import importlib.util
import os

import torch


def _torchvision_ops_load() -> bool:
    """Load torchvision's C++ ops library as torchvision itself will (torch remembers it); False where it fails."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return True  # no torchvision: nothing to make importable
    libraries = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    if not libraries:
        return False
    try:
        torch.ops.load_library(libraries[0])
    except (OSError, RuntimeError):
        return False
    return True


def ensure_torchvision_importable() -> None:
    if _torchvision_ops_load():
        return
    for name, schema in (
        ("nms", "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"),
        ("qnms", "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"),
    ):
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
            continue  # real op (or an earlier shim) already registered
        except RuntimeError:
            pass
        lib = torch.library.Library("torchvision", "FRAGMENT")
        lib.define(schema)
        _KEEP_ALIVE.append(lib)  # a Library object unregisters its ops when garbage-collected


_KEEP_ALIVE: list = []
