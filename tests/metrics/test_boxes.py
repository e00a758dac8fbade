"""Box IoU / GIoU / Acc@0.5 (metrics/boxes.py) against torchvision's pairwise box_iou and generalized_box_iou
(an independent implementation: we take their diagonal) and a hand-worked case."""
from __future__ import annotations

import pytest
import torch
from torchvision.ops import box_iou, generalized_box_iou

from mplug_pretrain.metrics.boxes import accuracy_at, paired_giou, paired_iou, xywh_to_xyxy


def _random_boxes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g)
    wh = torch.rand(n, 2, generator=g) * 0.6 + 1e-3
    return xywh_to_xyxy(torch.cat([xy, wh], 1))


def test_iou_and_giou_match_torchvision_on_random_pairs():
    a, b = _random_boxes(500, 0), _random_boxes(500, 1)
    b[:50] = a[:50]  # identical pairs: IoU = GIoU = 1
    b[50:100] = a[50:100] + 2.0  # far apart: IoU 0, GIoU < 0
    torch.testing.assert_close(paired_iou(a, b), box_iou(a, b).diagonal())
    torch.testing.assert_close(paired_giou(a, b), generalized_box_iou(a, b).diagonal())
    assert bool((paired_iou(a[:50], b[:50]) == 1).all()) and bool((paired_giou(a[50:100], b[50:100]) < 0).all())


def test_hand_worked_case():
    # A = [0,0,2,2] (area 4), B = [1,1,3,3] (area 4): intersection 1, union 7, enclosing [0,0,3,3] area 9
    a, b = torch.tensor([[0.0, 0, 2, 2]]), torch.tensor([[1.0, 1, 3, 3]])
    assert float(paired_iou(a, b)) == pytest.approx(1 / 7)
    assert float(paired_giou(a, b)) == pytest.approx(1 / 7 - (9 - 7) / 9)
    assert xywh_to_xyxy(torch.tensor([1.0, 2, 3, 4])).tolist() == [1, 2, 4, 6]


def test_iou_is_unchanged_by_scaling_both_boxes_per_axis():
    a, b = _random_boxes(100, 2), _random_boxes(100, 3)
    scale = torch.tensor([640.0, 480, 640, 480])
    torch.testing.assert_close(paired_iou(a * scale, b * scale), paired_iou(a, b))


def test_accuracy_at_counts_the_threshold_itself():
    assert accuracy_at(torch.tensor([0.5, 0.49, 0.9, 0.0])) == 50.0
    assert accuracy_at(torch.tensor([])) == 0.0
