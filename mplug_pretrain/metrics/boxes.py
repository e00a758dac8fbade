"""Box geometry for visual grounding: IoU, generalized IoU (Rezatofighi et al., 2019) and Acc@0.5.

Boxes are ``[..., 4]`` tensors, either (x, y, w, h) (top-left corner, width, height: COCO / RefCOCO, and what the
grounding decoder emits) or (x1, y1, x2, y2). Every function here pairs box i of ``a`` with box i of ``b``
(the diagonal of torchvision's pairwise ``box_iou``), in whatever unit both share: IoU is unchanged when both
boxes are scaled by the same (sx, sy), so normalised and pixel coordinates give the same figures.
    IoU  = |A n B| / |A u B|                (0 when the union is empty)
    GIoU = IoU - |C \\ (A u B)| / |C|         C the smallest box enclosing A and B; in [-1, 1]
    Acc@0.5 = share of predictions with IoU >= 0.5 (mPLUG Table 4, RefCOCO / RefCOCO+ / RefCOCOg)
"""
from __future__ import annotations

import torch


def xywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    x, y, w, h = boxes.unbind(-1)
    return torch.stack([x, y, x + w, y + h], dim=-1)


def _area(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[..., 2] - boxes[..., 0]).clamp_min(0) * (boxes[..., 3] - boxes[..., 1]).clamp_min(0)


def _intersection_union(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low = torch.maximum(a[..., :2], b[..., :2])
    high = torch.minimum(a[..., 2:], b[..., 2:])
    inter = (high - low).clamp_min(0).prod(-1)
    return inter, _area(a) + _area(b) - inter


def paired_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x1y1x2y2 boxes [..., 4] and [..., 4] -> IoU [...] of each pair."""
    inter, union = _intersection_union(a, b)
    return torch.where(union > 0, inter / union.clamp_min(1e-12), torch.zeros_like(union))


def paired_giou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x1y1x2y2 boxes -> generalized IoU [...] of each pair (module docstring)."""
    inter, union = _intersection_union(a, b)
    iou = torch.where(union > 0, inter / union.clamp_min(1e-12), torch.zeros_like(union))
    enclosing = _area(torch.cat([torch.minimum(a[..., :2], b[..., :2]), torch.maximum(a[..., 2:], b[..., 2:])], -1))
    return iou - torch.where(enclosing > 0, (enclosing - union) / enclosing.clamp_min(1e-12),
                             torch.zeros_like(enclosing))


def accuracy_at(ious: torch.Tensor, threshold: float = 0.5) -> float:
    """Percentage of IoUs >= threshold (None-free: an empty tensor gives 0)."""
    return 100.0 * float((ious >= threshold).float().mean()) if ious.numel() else 0.0
