"""CLIP ViT image encoder returning every token, and the image branch of mPLUG (ViT -> projection -> refiner).

VisionTransformer(image [B, 3, H, W]) -> tokens [B, 1 + M, D], M = (H / patch) * (W / patch):
    x = [class_embedding; conv1(image) patches] + positional_embedding   (bilinearly resized when the
        input grid differs from the stored one)
    x = ln_pre(x); x = x + Attn(ln_1(x)); x = x + MLP(ln_2(x)) per block (pre-LN, QuickGELU as OpenAI CLIP)
    tokens = ln_post(x)  -- CLS first, all tokens kept, no CLIP projection (mPLUG ``skip_last_layer``).
Parameter names are OpenAI CLIP's visual tower names (``conv1``, ``transformer.resblocks.{i}.attn.in_proj_weight``
...), so OpenAI / open_clip weights load by stripping ``visual.`` (timm names: ``vision_checkpoint``).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.factory import build_visual_refiner
from mplug_pretrain.models.layers.checkpointing import run_layer
from mplug_pretrain.models.model_config import VisionConfig, VisualRefinerConfig
from mplug_pretrain.models.towers.external import ExternalTower, parse_backbone

CLIP_LN_EPS = 1e-5


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the activation OpenAI CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": QuickGELU, "gelu": nn.GELU}


def resize_positional_embedding(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """[1 + g0*g0, D] -> [1 + grid*grid, D]: class row kept, patch grid resized bilinearly (align_corners=False)."""
    old = round((pos.shape[0] - 1) ** 0.5)
    if old * old != pos.shape[0] - 1:
        raise ValueError(f"positional embedding with {pos.shape[0] - 1} patch rows is not a square grid")
    if old == grid:
        return pos
    patches = pos[1:].float().reshape(1, old, old, -1).permute(0, 3, 1, 2)
    patches = F.interpolate(patches, size=(grid, grid), mode="bilinear", align_corners=False)
    patches = patches.permute(0, 2, 3, 1).reshape(grid * grid, -1).to(pos.dtype)
    return torch.cat([pos[:1], patches], dim=0)


class ViTAttention(nn.Module):
    """Self-attention with a packed ``in_proj_weight`` [3D, D] (nn.MultiheadAttention layout), run by SDPA."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.normal_(self.in_proj_weight, std=width ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, act: str):
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.ln_1 = nn.LayerNorm(width, eps=CLIP_LN_EPS)
        self.attn = ViTAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width, eps=CLIP_LN_EPS)
        self.mlp = nn.Sequential(OrderedDict(
            c_fc=nn.Linear(width, hidden), act=ACTIVATIONS[act](), c_proj=nn.Linear(hidden, width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """Holds the blocks under CLIP's name ``transformer.resblocks``."""

    def __init__(self, width: int, layers: int, heads: int, mlp_ratio: float, act: str):
        super().__init__()
        self.resblocks = nn.ModuleList(ResidualAttentionBlock(width, heads, mlp_ratio, act) for _ in range(layers))


class VisionTransformer(nn.Module):
    """CLIP visual tower without the final projection; see the module docstring."""

    def __init__(self, image_size: int, patch_size: int, width: int, layers: int, heads: int,
                 mlp_ratio: float = 4.0, act: str = "quick_gelu"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"ViT activation must be one of {sorted(ACTIVATIONS)}, got {act!r}")
        self.patch_size = patch_size
        self.grid = image_size // patch_size
        scale = width ** -0.5
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(1 + self.grid ** 2, width))
        self.ln_pre = nn.LayerNorm(width, eps=CLIP_LN_EPS)
        self.transformer = Transformer(width, layers, heads, mlp_ratio, act)
        self.ln_post = nn.LayerNorm(width, eps=CLIP_LN_EPS)
        self.grad_checkpointing = False

    def no_weight_decay(self) -> set[str]:
        return {"class_embedding", "positional_embedding"}

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if image.ndim != 4 or image.shape[1] != 3:
            raise ValueError(f"image must be [B, 3, H, W], got {tuple(image.shape)}")
        h, w = image.shape[-2:]
        if h % self.patch_size or w % self.patch_size or h != w:
            raise ValueError(f"image size {h}x{w} must be square and a multiple of patch size {self.patch_size}")
        x = self.conv1(image).flatten(2).transpose(1, 2)  # [B, M, D]
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        pos = resize_positional_embedding(self.positional_embedding, h // self.patch_size)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + pos.to(x.dtype))
        for block in self.transformer.resblocks:
            x = run_layer(block, x, enabled=self.grad_checkpointing)
        return self.ln_post(x)


class VisualProjection(nn.Module):
    """Linear + LayerNorm + Dropout from vision width to text width (mPLUG ViT-L: 1024 -> 768)."""

    def __init__(self, vision_width: int, text_width: int, dropout: float):
        super().__init__()
        self.linear = nn.Linear(vision_width, text_width)
        self.norm = nn.LayerNorm(text_width, eps=1e-12)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.linear(x)))


class ImageEncoder(nn.Module):
    """image [B, 3, H, W] -> visual states [B, 1 + M, text_width]: ViT (ours, or a timm / open_clip tower by
    ``vision.backbone``: models/towers/external.py), projection (if widths differ), refiner."""

    def __init__(self, cfg: VisionConfig, text_width: int, dropout: float, refiner: VisualRefinerConfig):
        super().__init__()
        self.vit: nn.Module
        if parse_backbone(cfg.backbone)[0] == "clip_vit":
            self.vit = VisionTransformer(cfg.image_size, cfg.patch_size, cfg.width, cfg.layers, cfg.heads,
                                         cfg.mlp_ratio)
            width, grid = cfg.width, cfg.image_size // cfg.patch_size
        else:  # a timm / open_clip tower: its own width and grid
            self.vit = ExternalTower(cfg.backbone, cfg.image_size, cfg.backbone_kwargs, cfg.backbone_pretrained)
            width, grid = self.vit.width, self.vit.grid
        self.projection: VisualProjection | None = None
        if width != text_width:
            if not cfg.project_to_text_width:
                raise ConfigError(f"model.vision.project_to_text_width: vision width {width} differs from "
                                  f"text width {text_width}; a projection is required")
            self.projection = VisualProjection(width, text_width, dropout)
        self.refiner = build_visual_refiner(refiner, width=text_width, grid_size=grid)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return states_from_vit_tokens(self, self.vit(image))


def states_from_vit_tokens(image_encoder: ImageEncoder, tokens: torch.Tensor) -> torch.Tensor:
    """The part of ``ImageEncoder.forward`` after the ViT: tokens [B, 1+M, D_vit] -> states [B, 1+M, D].
    Used alone on cached or frozen-ViT tokens (tasks/caption/feature_cache.py)."""
    x = tokens
    if image_encoder.projection is not None:
        x = image_encoder.projection(x)
    if image_encoder.refiner is not None:
        x = image_encoder.refiner(x)
    return x
