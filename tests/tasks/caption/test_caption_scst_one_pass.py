"""One-pass SCST (models.generation.sample_with_grad): for the same random draws it samples the same captions as
the no-grad sampler, and its loss and gradients (decoder parameters and memory) equal those of sampling then
recomputing the log-probabilities by teacher forcing, for every decoder type. In float64, so that the 1e-5
tolerance measures the method, not float32 rounding (in float32 the two differ by up to 8e-4 on gradient entries
of ~45 for the expansion decoder; in float64 by < 1e-11)."""
import numpy as np
import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.models.decoders.api import EOS_ID
from mplug_pretrain.models.decoders.factory import build_decoder
from mplug_pretrain.models.generation import decoding as G
from mplug_pretrain.models.model_config import DecoderConfig
from mplug_pretrain.tasks.caption.scst import scst_loss

pytestmark = pytest.mark.usefixtures("one_thread")
DECODERS = ("bert", "expansion", "acf")
V, W, K, MAX_LENGTH = 300, 32, 4, 8


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _decoder(kind: str):
    torch.manual_seed(0)
    decoder = build_decoder(DecoderConfig(type=kind, layers=2, heads=4, ffn_dim=64, max_positions=40, dropout=0.0),
                            vocab_size=V, width=W).double().eval()
    head_bias = decoder.head.bias if kind == "bert" else decoder.lm_head.bias
    with torch.no_grad():  # EOS likely enough that samples end at different lengths, some cut at MAX_LENGTH
        head_bias[EOS_ID] += 4.0
    return decoder


def _memory():
    g = torch.Generator().manual_seed(1)
    memory = torch.randn(3, 5, W, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[2, -2:] = 0
    return memory, mask


def _reward(image_ids, texts, finished):  # differs between the samples of an image: non-zero advantages
    return np.array([len(t) + 3 * f for t, f in zip(texts, finished)], dtype=np.float64)


@pytest.mark.parametrize("kind", DECODERS)
def test_sampling_with_grad_draws_the_same_sequences_and_teacher_forced_gradients(kind):
    decoder, (memory, mask) = _decoder(kind), _memory()
    plain_seqs, plain_lp = G.sample(decoder, memory, mask, num_samples=K, max_length=MAX_LENGTH,
                                    generator=torch.Generator().manual_seed(5))
    seqs, lp = G.sample_with_grad(decoder, memory, mask, num_samples=K, max_length=MAX_LENGTH,
                                  generator=torch.Generator().manual_seed(5))
    assert torch.equal(seqs, plain_seqs)
    ended = (seqs == EOS_ID).any(1)
    assert ended.any() and not ended.all() and seqs.shape[1] == MAX_LENGTH  # both kinds of sample occur
    torch.testing.assert_close(lp.detach(), plain_lp, rtol=0, atol=0)
    # independent: the teacher-forced log-probabilities of the same sequences, differentiated
    forced = G.sequence_log_probs(decoder, *G.expand_memory(decoder, memory, mask, K), seqs)
    torch.testing.assert_close(lp, forced, rtol=1e-5, atol=1e-5)
    weights = torch.randn(lp.shape[0], generator=torch.Generator().manual_seed(2))
    inputs = [memory, *decoder.parameters()]
    ours = torch.autograd.grad((weights * lp).sum(), inputs, allow_unused=True)
    reference = torch.autograd.grad((weights * forced).sum(), inputs, allow_unused=True)
    for a, b in zip(ours, reference):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ours[0].abs().sum() > 0  # the gradient reaches the memory


@pytest.mark.parametrize("kind", DECODERS)
def test_one_pass_scst_loss_and_gradients_equal_the_two_pass_ones(kind, tokenizer):
    decoder, (memory, mask) = _decoder(kind), _memory()
    params = list(decoder.parameters())
    out, grads = {}, {}
    for one_pass in (False, True):
        torch.manual_seed(7)  # the same draws both ways
        out[one_pass] = scst_loss(decoder, memory, mask, [11, 12, 13], _reward, tokenizer, k=K,
                                  max_length=MAX_LENGTH, one_pass=one_pass)
        grads[one_pass] = torch.autograd.grad(out[one_pass]["loss"], [memory, *params], allow_unused=True)
    two, one = out[False], out[True]
    assert torch.equal(one["sampled_log_probs"], two["sampled_log_probs"])
    assert one["loss_reward"].item() == two["loss_reward"].item()  # same captions, same rewards
    assert one["loss"].item() != 0.0
    torch.testing.assert_close(one["loss"], two["loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one["log_probs"], two["log_probs"], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[True], grads[False]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert grads[True][0].abs().sum() > 0
