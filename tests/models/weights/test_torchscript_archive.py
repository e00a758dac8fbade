"""TorchScript archives (OpenAI CLIP's released format) are read as data: a CLIP-like archive gives the weights
``torch.jit.load`` gives and the same image features; a crafted archive's ``__setstate__`` never runs; an archive
naming any other global is refused with the file and the name."""
from __future__ import annotations

import io
import os
import pickle
import zipfile

import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim before open_clip's models)
from mplug_pretrain.models.towers.vision import VisionTransformer
from mplug_pretrain.models.weights.clip_vision import load_vision_checkpoint, read_state_dict
from mplug_pretrain.models.weights.reader import UnsafeFileError
from mplug_pretrain.models.weights.torchscript_archive import (
    is_torchscript_archive,
    read_torchscript_state_dict,
)
from tests.models.weights.torchscript_payloads import save_trapped_archive

CFG = {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "heads": 4}


def _image():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _clip():
    import open_clip  # after mplug_pretrain's torchvision shim
    torch.manual_seed(0)
    return open_clip.CLIP(embed_dim=16, vision_cfg={"image_size": 32, "patch_size": 8, "width": 64, "layers": 2,
                                                    "head_width": 16},
                          text_cfg={"context_length": 8, "vocab_size": 50, "width": 32, "heads": 2, "layers": 1},
                          quick_gelu=True).eval()


def test_clip_like_archive_is_read_as_data(tmp_path):
    clip = _clip()
    path = str(tmp_path / "ViT-tiny.pt")
    torch.jit.trace_module(clip, {"encode_image": _image()}, check_trace=False).save(path)  # how OpenAI's archives were made
    assert is_torchscript_archive(path)
    got = read_torchscript_state_dict(path)
    trusted = torch.jit.load(path).state_dict()  # our own file: safe to compare with here
    assert sorted(got) == sorted(trusted) and "visual.conv1.weight" in got and "token_embedding.weight" in got
    for key, value in trusted.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    ours = VisionTransformer(**CFG).eval()
    load_vision_checkpoint(ours, path)
    with torch.no_grad():
        assert torch.allclose(ours(_image())[:, 0] @ clip.visual.proj, clip.encode_image(_image()), atol=1e-5)


def test_half_and_shared_storages_keep_dtype_and_views(tmp_path):
    module = torch.nn.Linear(3, 2).half()
    module.register_buffer("view", module.weight.data[1:])  # shares the weight's storage at an offset
    path = str(tmp_path / "half.pt")
    torch.jit.script(module).save(path)
    got = read_torchscript_state_dict(path)
    assert got["weight"].dtype == torch.float16 and torch.equal(got["view"], module.weight.data[1:])
    assert torch.equal(got["weight"], module.weight.data) and torch.equal(got["bias"], module.bias.data)


def test_crafted_archive_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    path = str(tmp_path / "ViT-B-16.pt")
    save_trapped_archive(path, str(marker), visual=torch.nn.Conv2d(3, 64, 8))
    torch.jit.load(path)  # the payload is real: TorchScript's loader runs it
    assert marker.exists()
    marker.unlink()
    state = read_state_dict(path)
    assert sorted(state) == ["visual.bias", "visual.weight"] and not marker.exists()
    with pytest.raises(ValueError, match="visual"):  # no ViT in it: refused by its keys, still nothing run
        load_vision_checkpoint(VisionTransformer(**CFG), path)
    assert not marker.exists()


class _System:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_archive_naming_another_global_is_refused(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps({"visual.conv1.weight": _System(marker)}, protocol=2))
        zf.writestr("evil/constants.pkl", pickle.dumps((), protocol=2))
        zf.writestr("evil/code/__torch__.py", "")
    with pytest.raises(UnsafeFileError, match=r"model\.vision\.checkpoint_path: .*evil\.pt: refused: .*(posix|os)\.system"):
        read_state_dict(str(path))
    assert not marker.exists()


def test_a_compressed_record_is_refused_before_inflating(tmp_path):
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("bomb/data.pkl", pickle.dumps({}, protocol=2))
        zf.writestr("bomb/constants.pkl", pickle.dumps((), protocol=2))
        zf.writestr("bomb/data/0", bytes(2**20))  # 1 MiB of zeros in ~1 KB: the pattern of a zip bomb
    with pytest.raises(RuntimeError, match=r"bomb\.pt: bomb/data\.pkl is compressed"):
        read_torchscript_state_dict(str(path))


def test_damaged_archive_names_the_file(tmp_path):
    path = str(tmp_path / "cut.pt")
    torch.jit.script(torch.nn.Linear(2, 2)).save(path)
    with zipfile.ZipFile(path) as zf:
        records = {n: zf.read(n) for n in zf.namelist() if "/data/" not in n}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:  # the storages left out
        for name, data in records.items():
            zf.writestr(name, data)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
    with pytest.raises(RuntimeError, match=r"cut\.pt: data\.pkl names storage '0'"):
        read_torchscript_state_dict(path)
