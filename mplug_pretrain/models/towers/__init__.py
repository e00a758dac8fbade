"""Vision towers other than our CLIP ViT, built by name through timm's and open_clip's factories
(``model.vision.backbone: timm:<name> | open_clip:<name>``); see external.py."""
from mplug_pretrain.models.towers.external import BACKBONE_KINDS, ExternalTower, parse_backbone

__all__ = ["BACKBONE_KINDS", "ExternalTower", "parse_backbone"]
