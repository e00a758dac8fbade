"""`mplug convert expansionnet` with settings the weights contradict (issue 36, items 5 and 7): one `mplug:` line
and exit 2, where a traceback used to be printed."""
import pytest
import torch

from tests.helpers import call_mplug
from tests.models.weights.test_convert_expansionnet import ENC_GROUP, HEADS, official_state_dict


@pytest.fixture
def official_file(tmp_path):
    path = tmp_path / "official.pth"
    torch.save({"model_state_dict": official_state_dict()}, path)
    return path


@pytest.mark.parametrize("setting, message", [
    (["--heads", "3"], "--heads 3: the checkpoint's width 16 is not divisible by it"),
    (["--heads", "0"], "--heads 0: the checkpoint's width 16 is not divisible by it"),
    (["--encoder-group", "4,4"], (f"--encoder-group 4,4: sums to 8, the checkpoint's static expansion has "
                                  f"{sum(ENC_GROUP)} query vectors")),
    (["--encoder-group", "4,x"], "--encoder-group 4,x: expected positive integers separated by commas, e.g. 32,64,128"),
])
def test_a_setting_the_weights_contradict_is_one_line(official_file, tmp_path, setting, message):
    args = ["--heads", str(HEADS), "--encoder-group", ",".join(map(str, ENC_GROUP)), *setting]
    proc = call_mplug(["convert", "expansionnet", "--checkpoint", official_file, "--out", tmp_path / "out", *args])
    assert (proc.returncode, proc.stderr) == (2, f"mplug: config error: {message}\n")
    assert not (tmp_path / "out").exists()
