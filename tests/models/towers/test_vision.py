"""CLIP ViT: loading open_clip / OpenAI-style / timm files written here, outputs equal to those libraries."""
from __future__ import annotations

import pickle

import open_clip
import pytest
import timm
import torch
from open_clip.transformer import QuickGELU
from open_clip.transformer import VisionTransformer as OpenClipViT
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed

from mplug_pretrain.models.towers.vision import VisionTransformer, resize_positional_embedding
from mplug_pretrain.models.weights.clip_vision import load_vision_checkpoint
from mplug_pretrain.models.weights.reader import UnsafeFileError

CFG = {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "heads": 4}


def _image(size=32):
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))


def test_open_clip_safetensors_loads_and_matches(tmp_path):
    torch.manual_seed(0)
    ref = OpenClipViT(image_size=32, patch_size=8, width=64, layers=2, heads=4, mlp_ratio=4.0, output_dim=16,
                      act_layer=QuickGELU, output_tokens=True).eval()
    path = tmp_path / "open_clip_visual.safetensors"
    save_file({"visual." + k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    ours = VisionTransformer(**CFG).eval()
    load_vision_checkpoint(ours, str(path))
    with torch.no_grad():
        pooled, tokens = ref(_image())
        got = ours(_image())
    assert got.shape == (2, 17, 64)
    assert torch.allclose(got[:, 1:], tokens, atol=1e-5)
    assert torch.allclose(got[:, 0] @ ref.proj, pooled, atol=1e-5)  # CLS before CLIP's projection


def test_openai_style_full_clip_file_drops_text_tower(tmp_path):
    torch.manual_seed(0)
    clip = open_clip.CLIP(embed_dim=16, vision_cfg={"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 16},
                          text_cfg={"context_length": 8, "vocab_size": 50, "width": 32, "heads": 2, "layers": 1},
                          quick_gelu=True).eval()
    path = tmp_path / "ViT-tiny.pt"
    torch.save(clip.state_dict(), path)
    ours = VisionTransformer(**CFG).eval()
    load_vision_checkpoint(ours, str(path), "openai")
    with torch.no_grad():
        expected = clip.encode_image(_image())
        got = ours(_image())[:, 0] @ clip.visual.proj
    assert torch.allclose(got, expected, atol=1e-5)


def test_timm_clip_vit_file_loads_and_matches(tmp_path):
    torch.manual_seed(0)
    ref = timm.create_model("vit_base_patch16_clip_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                            depth=2, num_heads=4, act_layer="quick_gelu", num_classes=16).eval()
    path = tmp_path / "timm_vit.pth"
    torch.save({"state_dict": {"module." + k: v for k, v in ref.state_dict().items()}}, path)
    ours = VisionTransformer(**CFG).eval()
    load_vision_checkpoint(ours, str(path))
    with torch.no_grad():
        assert torch.allclose(ours(_image()), ref.forward_features(_image()), atol=1e-5)


def test_positional_embedding_resize_matches_timm():
    pos = torch.randn(1 + 16, 64)
    got = resize_positional_embedding(pos, 6)
    expected = resample_abs_pos_embed(pos[None], new_size=(6, 6), old_size=(4, 4), num_prefix_tokens=1,
                                      interpolation="bilinear", antialias=False)[0]
    assert got.shape == (37, 64) and torch.allclose(got, expected, atol=1e-6)


def test_checkpoint_of_another_resolution_is_interpolated(tmp_path):
    torch.manual_seed(0)
    small = VisionTransformer(**CFG)
    path = tmp_path / "small.safetensors"
    save_file({k: v.contiguous() for k, v in small.state_dict().items()}, str(path))
    big = VisionTransformer(**{**CFG, "image_size": 48}).eval()
    load_vision_checkpoint(big, str(path))
    assert torch.allclose(big.positional_embedding, resize_positional_embedding(small.positional_embedding, 6))
    assert big(_image(48)).shape == (2, 37, 64)
    with torch.no_grad():  # a different input size is interpolated on the fly
        assert torch.allclose(small.eval()(_image(48)), big(_image(48)), atol=1e-5)


def test_mismatched_or_unsafe_files_are_refused(tmp_path):
    ours = VisionTransformer(**CFG)
    wide = VisionTransformer(**{**CFG, "width": 32, "heads": 2})
    path = tmp_path / "wide.safetensors"
    save_file({k: v.contiguous() for k, v in wide.state_dict().items()}, str(path))
    with pytest.raises(ValueError, match="vision.width"):
        load_vision_checkpoint(ours, str(path))
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"conv1.weight": torch.zeros(1), "obj": object()}, f, protocol=2)
    with pytest.raises(UnsafeFileError, match=r"model\.vision\.checkpoint_path: .*evil\.pt: refused: loading it would create"):
        load_vision_checkpoint(ours, str(evil))
