"""Classification over fused image-text states: SNLI-VE (3 classes, one image) and NLVR2 (2 classes, two images).

    image i of the example + statement -> text encoder + skip-connected fusion -> fused text [CLS] h_i [D]
    logits = Linear(D, C)(ReLU(Linear(I * D, D)(concat_i h_i)))          [B, C]

SNLI-VE: I = 1, ALBEF's head on the fused [CLS] (mPLUG: "encoder only, MLP on the fused text [CLS]").
NLVR2: I = 2. The paper merges two cross-attentions inside each fusion layer; with skip-connected fusion
(connected-attention layers that concatenate image and text) that merge has no single place, so each image is
fused with the statement on its own, through the unchanged pretrained fusion, and the two [CLS] states are
concatenated (the "pair" setting of UNITER / ViLT). No new fusion weights: fine-tuning starts from pretraining.
"""
from __future__ import annotations

import torch
from torch import nn


class FusedClassifier(nn.Module):
    def __init__(self, width: int, classes: int, images: int = 1):
        super().__init__()
        self.images = images
        self.hidden = nn.Linear(images * width, width)
        self.out = nn.Linear(width, classes)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        """cls_states [B, I, D] -> logits [B, C] (fp32)."""
        joined = cls_states.flatten(1)
        return self.out(torch.relu(self.hidden(joined))).float()
