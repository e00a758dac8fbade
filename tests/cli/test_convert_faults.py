"""`mplug convert expansionnet` with settings the weights contradict (issue 36, items 5 and 7): one `mplug:` line
and exit 2, where a traceback used to be printed."""
import pytest
import torch

from tests.helpers import call_mplug
from tests.models.weights.test_convert_expansionnet import (
    ENC_GROUP,
    HEADS,
    VOCAB,
    D,
    official_decoder,
    official_encoder,
    official_state_dict,
)


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


@pytest.fixture
def official_outputs(tmp_path):
    """What a user saves from the official model on a fixed input (here the test's independent re-implementation
    of the official forward, 2 heads, encoder group 2,3,4)."""
    sd = official_state_dict()
    g = torch.Generator().manual_seed(7)
    tokens, ids = torch.randn(2, 6, D, generator=g), torch.randint(0, VOCAB, (2, 5), generator=g)
    memory = official_encoder(sd, tokens)
    path = tmp_path / "official_outputs.pt"
    torch.save({"encoder_input": tokens, "encoder_output": memory, "decoder_ids": ids,
                "decoder_logits": official_decoder(sd, memory, ids)}, path)
    return path


def _convert(official_file, tmp_path, *args):
    return call_mplug(["convert", "expansionnet", "--checkpoint", official_file, "--out", tmp_path / "out", *args])


@pytest.mark.parametrize("setting, refused, reproduces", [
    (["--heads", "4", "--encoder-group", "2,3,4"], "--heads 4: the converted decoder's logits differ", "--heads 2"),
    (["--heads", "2", "--encoder-group", "4,3,2"], "--encoder-group 4,3,2: the converted encoder's outputs differ",
     "--encoder-group 2,3,4"),
])
def test_settings_the_outputs_contradict_are_refused_naming_the_one_that_fits(official_file, official_outputs,
                                                                             tmp_path, setting, refused, reproduces):
    proc = _convert(official_file, tmp_path, *setting, "--compare", official_outputs)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"mplug: config error: {refused} from {official_outputs}'s by up to ")
    assert proc.stderr.endswith(f"; {reproduces} reproduces them\n"), proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_right_settings_are_confirmed_and_unchecked_ones_said(official_file, official_outputs, tmp_path):
    right = ["--heads", str(HEADS), "--encoder-group", ",".join(map(str, ENC_GROUP))]
    proc = _convert(official_file, tmp_path, *right, "--compare", official_outputs)
    assert proc.returncode == 0, proc.stderr
    assert f"decoder logits match {official_outputs}" in proc.stdout and f"--heads {HEADS}" in proc.stdout
    assert f"encoder outputs match {official_outputs}" in proc.stdout
    proc = _convert(official_file, tmp_path, "--heads", "4", "--encoder-group", "4,3,2")  # no reference: said so
    assert proc.returncode == 0, proc.stderr
    assert ("not in the weights, so not checked: --heads 4, --encoder-group 4,3,2 (their sum is); check them with "
            "--compare FILE") in proc.stdout


def test_a_converted_folder_builds_the_modules_that_give_the_official_outputs(official_file, official_outputs,
                                                                              tmp_path):
    """The library route from `mplug convert`'s folder to our modules (read_conversion + build_decoder /
    build_refiner), on the official outputs the user saved."""
    from mplug_pretrain.models.weights.expansionnet_check import build_decoder, build_refiner
    from mplug_pretrain.models.weights.expansionnet_official import read_conversion
    right = ["--heads", str(HEADS), "--encoder-group", ",".join(map(str, ENC_GROUP))]
    assert _convert(official_file, tmp_path, *right).returncode == 0
    conversion = read_conversion(tmp_path / "out")
    ref = torch.load(official_outputs, weights_only=True)
    with torch.no_grad():
        memory = build_refiner(conversion, tokens=6)(ref["encoder_input"])
        ids = ref["decoder_ids"]
        logits = build_decoder(conversion)(ids, torch.ones(ids.shape), memory, torch.ones(memory.shape[:2])).logits
    torch.testing.assert_close(memory, ref["encoder_output"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref["decoder_logits"], rtol=1e-5, atol=1e-5)
