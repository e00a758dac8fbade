"""Import-time compatibility shims, kept in one place.

torchvision wheels on PyPI are CUDA builds; with a CPU-only torch their C++ ops library does not
load and ``import torchvision`` (hence timm / open_clip) fails with
``operator torchvision::nms does not exist``. Defining the two op schemas before torchvision is
imported lets its Python parts (transforms, models) import. Where the real ops exist this is a no-op.
"""
import torch


def ensure_torchvision_importable() -> None:
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
