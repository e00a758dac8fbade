"""Loading never runs code from a file: a pickle whose object would call a function (here ``exec``, writing a
marker file) is refused with the file's path and the object's name, and the payload never runs; the refusal
also covers loads we do not own (DeepSpeed's checkpoint engine passes ``weights_only=False``) inside
``weights_only_loads``. The few DeepSpeed classes of its checkpoints load. Model files are written 0644 under
umask 022 (safetensors' own writer makes them 0600)."""
import os
import pickle

import pytest
import torch

from mplug_pretrain.errors import DataError
from mplug_pretrain.models.weights.reader import (
    UnsafeFileError,
    read_torch_file,
    save_weights,
    weights_only_loads,
)
from mplug_pretrain.train.checkpoint import deepspeed_safe_globals


class Payload:
    """What a malicious checkpoint holds: unpickling it calls ``exec``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def plant(path, marker) -> None:
    """A torch file holding tensors and, beside them, the payload."""
    torch.save({"module": {"w": torch.ones(2)}, "note": Payload(str(marker))}, path)


def test_payload_is_real(tmp_path):
    """The payload does run under plain unpickling: the refusals below are what stops it."""
    plant(tmp_path / "f.pt", tmp_path / "ran")
    torch.load(tmp_path / "f.pt", weights_only=False)
    assert (tmp_path / "ran").read_text() == "ran"


def test_read_torch_file_refuses_naming_file_and_object(tmp_path):
    plant(tmp_path / "evil.pt", tmp_path / "ran")
    with pytest.raises(UnsafeFileError) as err:
        read_torch_file(str(tmp_path / "evil.pt"))
    assert str(tmp_path / "evil.pt") in str(err.value) and "builtins.exec" in str(err.value)
    assert isinstance(err.value, DataError)  # the CLI prints it as one line
    assert not (tmp_path / "ran").exists()


def test_legacy_format_payload_is_refused_too(tmp_path):
    """The pre-zip torch format cannot be scanned; the weights-only loader refuses it and names the object."""
    torch.save({"w": torch.ones(2), "note": Payload(str(tmp_path / "ran"))}, tmp_path / "old.pt",
               _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeFileError, match="old.pt: refused: .*exec"):
        read_torch_file(str(tmp_path / "old.pt"))
    assert not (tmp_path / "ran").exists()


def test_deepspeed_checkpoint_engine_load_is_forced_weights_only(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    plant(tmp_path / "mp_rank_00_model_states.pt", tmp_path / "ran")
    with weights_only_loads(deepspeed_safe_globals()), pytest.raises(pickle.UnpicklingError, match="exec"):
        TorchCheckpointEngine().load(str(tmp_path / "mp_rank_00_model_states.pt"), map_location="cpu")
    assert not (tmp_path / "ran").exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # the switch does not outlive the block


def test_deepspeed_classes_of_its_checkpoints_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    torch.save({"loss_scaler": LossScaler(2.0), "zero_stage": ZeroStageEnum.gradients,
                "param_slice_mappings": [{"w": fragment_address(numel=4, start=8)}]}, tmp_path / "optim.pt")
    state = read_torch_file(str(tmp_path / "optim.pt"), deepspeed_safe_globals())
    assert state["loss_scaler"].cur_scale == 2.0 and state["zero_stage"] is ZeroStageEnum.gradients
    assert state["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=8)
    with pytest.raises(UnsafeFileError, match="LossScaler"):  # not without the allow-list
        read_torch_file(str(tmp_path / "optim.pt"))


def test_model_weights_respect_the_umask(tmp_path):
    before = os.umask(0o022)
    try:
        save_weights(torch.nn.Linear(2, 2), str(tmp_path / "model.safetensors"))
    finally:
        os.umask(before)
    assert os.stat(tmp_path / "model.safetensors").st_mode & 0o777 == 0o644
