"""SCST (tasks/caption/scst.py): the leave-one-out baseline and the loss against hand computations, the sign of the
update on a toy policy whose reward is known, the SacreEOS "standard" reward, caption cleaning."""
import math

import numpy as np
import pytest
import torch
from torch import nn

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.metrics.cider_d import CiderD
from mplug_pretrain.models.decoders.api import EOS_ID, DecoderOutput
from mplug_pretrain.models.generation.decoding import sample
from mplug_pretrain.tasks.caption.losses import scst_batch_loss
from mplug_pretrain.tasks.caption.scst import CiderDReward, policy_mode, scst_loss, self_critical_loss

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_baseline_is_mean_of_the_other_samples_and_loss_matches_hand_computation():
    # image 0: r = (1, 0, 2) -> b = ((0+2)/2, (1+2)/2, (1+0)/2) = (1, 1.5, 0.5) -> r - b = (0, -1.5, 1.5)
    # image 1: equal rewards -> r - b = 0
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.5, 0.5])
    log_probs = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], requires_grad=True)
    loss, advantage = self_critical_loss(log_probs, rewards, k=3)
    assert advantage.tolist() == [0.0, -1.5, 1.5, 0.0, 0.0, 0.0]
    hand = -(0.0 * -1 + -1.5 * -2 + 1.5 * -3) / 6  # -(mean of (r - b) log p) = 0.25
    assert loss.item() == pytest.approx(hand) == pytest.approx(0.25)
    loss.backward()
    # dL/dlog p = -(r - b) / (N k): descent raises log p of the better-than-baseline sample only
    assert log_probs.grad.tolist() == pytest.approx([0.0, 0.25, -0.25, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="k"):
        self_critical_loss(log_probs, rewards, k=1)
    with pytest.raises(ValueError, match="N \\* k"):
        self_critical_loss(log_probs[:5], rewards[:5], k=3)


class UnigramPolicy(nn.Module):
    """A decoder (decoder_api) whose next-token distribution ignores the context: softmax(bias) over the
    allowed tokens. log p of a sequence is therefore known in closed form."""

    def __init__(self, allowed: list[int], vocab: int = 3000):
        super().__init__()
        self.allowed = allowed
        self.bias = nn.Parameter(torch.zeros(len(allowed)))
        self.vocab = vocab

    def forward(self, input_ids, attention_mask, memory, memory_mask, past=None, use_cache=False):
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        logits[..., self.allowed] = self.bias
        return DecoderOutput(logits + 0 * memory.sum(), past)

    @staticmethod
    def reorder_cache(past, index):
        return past

    def token_log_prob(self, token: int) -> float:
        return float(self.bias.detach().log_softmax(0)[self.allowed.index(token)])


def test_scst_loss_on_a_toy_policy_equals_the_hand_computation(tokenizer):
    red, blue = tokenizer.convert_tokens_to_ids(["red", "blue"])
    policy = UnigramPolicy([red, blue, EOS_ID])
    with torch.no_grad():
        policy.bias.copy_(torch.tensor([0.3, -0.2, 0.1]))
    memory, mask = torch.zeros(2, 3, 4), torch.ones(2, 3, dtype=torch.long)

    def reward(image_ids, texts, finished):  # known reward: the number of "red" words
        return np.array([t.split().count("red") for t in texts], dtype=np.float64)

    torch.manual_seed(3)
    out = scst_loss(policy, memory, mask, [7, 8], reward, tokenizer, k=4, max_length=6)
    torch.manual_seed(3)  # the same draws, by hand
    sequences, _ = sample(policy, memory, mask, num_samples=4, max_length=6)
    r, lp = [], []
    for row in sequences.tolist():
        tokens = row[:row.index(EOS_ID) + 1] if EOS_ID in row else row
        r.append(float(tokens.count(red)))
        lp.append(sum(policy.token_log_prob(t) for t in tokens))
    r, lp = np.array(r).reshape(2, 4), np.array(lp).reshape(2, 4)
    baseline = (r.sum(1, keepdims=True) - r) / 3
    hand = -np.mean((r - baseline) * lp)
    assert out["loss"].item() == pytest.approx(hand, rel=1e-5)
    assert out["loss_reward"].item() == pytest.approx(r.mean())


@pytest.mark.parametrize("rewarded, direction", [("red", 1), ("blue", -1)])
def test_descent_on_the_scst_loss_moves_probability_towards_the_rewarded_word(tokenizer, rewarded, direction):
    red, blue = tokenizer.convert_tokens_to_ids(["red", "blue"])
    policy = UnigramPolicy([red, blue, EOS_ID])
    memory, mask = torch.zeros(8, 2, 4), torch.ones(8, 2, dtype=torch.long)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)

    def reward(image_ids, texts, finished):
        return np.array([t.split().count(rewarded) for t in texts], dtype=np.float64)

    torch.manual_seed(0)
    before = math.exp(policy.token_log_prob(red))
    for _ in range(20):
        out = scst_loss(policy, memory, mask, list(range(8)), reward, tokenizer, k=5, max_length=4)
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
    after = math.exp(policy.token_log_prob(red))
    assert (after - before) * direction > 0.2, (before, after)


def test_reward_keeps_eos_in_samples_and_references_standard_mode():
    refs = {10: ["A red circle.", "a red circle on the left"], 11: ["two blue squares"], 12: ["a green one"]}
    reward = CiderDReward(refs, sigma=6.0, eos_in_reward=True)
    hyps = ["a red circle", "a red circle", "blue squares"]
    finished = [True, False, True]
    got = reward([10, 10, 11], hyps, finished)
    # independent: EOS appended by hand, scored in "none" mode (df from the three training images)
    by_hand = CiderD([[r + " <eos>" for r in ["a red circle", "a red circle on the left"]],
                      ["two blue squares <eos>"], ["a green one <eos>"]], eos_mode="none")
    expected = by_hand.score(["a red circle <eos>", "a red circle", "blue squares <eos>"], [0, 0, 1], df="fixed")
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert got[0] > got[1]  # a sample that ended with EOS matches the references' EOS n-grams
    without = CiderDReward(refs, eos_in_reward=False)([10], ["a red circle"], [True])
    plain = CiderD([["a red circle", "a red circle on the left"], ["two blue squares"], ["a green one"]])
    np.testing.assert_allclose(without, plain.score(["a red circle"], [0], df="fixed"), atol=1e-12)
    with pytest.raises(KeyError, match="99"):
        reward([99], ["x"], [True])


def test_scst_batch_is_image_wise_and_ignores_padding(tokenizer):
    """Rows of the same image collapse to one; padding rows take no part; k samples per image."""
    from mplug_pretrain.models.presets import build_model
    torch.manual_seed(0)
    model = build_model("tiny", **{"heads.use_momentum": False})
    seen = []

    def reward(image_ids, texts, finished):
        seen.append(list(image_ids))
        return np.zeros(len(image_ids))

    batch = {"image": torch.randn(5, 3, 64, 64), "image_id": torch.tensor([4, 9, 4, 2, 9]),
             "is_pad": torch.tensor([False, False, False, False, True])}
    prompt = torch.tensor([[101, 1037, 3861, 1997, 102]])
    out = scst_batch_loss(model, batch, True, prompt, reward, tokenizer, k=3, max_length=3)
    assert seen == [[4, 4, 4, 9, 9, 9, 2, 2, 2]]
    assert out["loss"].item() == 0.0  # zero rewards -> zero advantage


def _dropout_model():
    from mplug_pretrain.models.presets import build_model
    torch.manual_seed(0)
    model = build_model("tiny", **{"heads.use_momentum": False, "decoder.dropout": 0.5, "text.dropout": 0.5})
    model.image_encoder.eval()  # a part the caller set to eval must stay so
    return model


def test_scst_recomputes_the_log_probs_of_the_network_that_sampled(tokenizer):
    """With dropout on, the teacher-forced recomputation would see other masks than the sampler; inside
    policy_mode both are the same dropout-free network and their log-probabilities agree."""
    model = _dropout_model()
    memory, mask = torch.randn(3, 5, model.config.text.width), torch.ones(3, 5, dtype=torch.long)

    def reward(image_ids, texts, finished):
        return np.arange(len(image_ids), dtype=np.float64)

    torch.manual_seed(1)
    with policy_mode(model):
        inside = scst_loss(model.decoder, memory, mask, [1, 2, 3], reward, tokenizer, k=2, max_length=6,
                           one_pass=False)
    torch.testing.assert_close(inside["log_probs"].detach(), inside["sampled_log_probs"], atol=1e-4, rtol=1e-5)
    torch.manual_seed(1)
    outside = scst_loss(model.decoder, memory, mask, [1, 2, 3], reward, tokenizer, k=2, max_length=6,
                        one_pass=False)
    assert (outside["log_probs"].detach() - outside["sampled_log_probs"]).abs().max() > 1e-2
    assert model.training and model.decoder.training and not model.image_encoder.training


@pytest.mark.parametrize("one_pass", [False, True])
def test_scst_batch_loss_is_the_dropout_free_networks_loss(tokenizer, one_pass):
    model = _dropout_model()

    def reward(image_ids, texts, finished):
        return np.array([len(t.split()) for t in texts], dtype=np.float64)

    batch = {"image": torch.randn(2, 3, 64, 64), "image_id": torch.tensor([4, 9]), "is_pad": torch.tensor([False, False])}
    prompt = torch.tensor([[101, 1037, 3861, 1997, 102]])
    torch.manual_seed(2)
    in_training_mode = scst_batch_loss(model, batch, True, prompt, reward, tokenizer, k=3, max_length=5,
                                       one_pass=one_pass)
    assert model.training and not model.image_encoder.training
    model.eval()
    torch.manual_seed(2)
    in_eval_mode = scst_batch_loss(model, batch, True, prompt, reward, tokenizer, k=3, max_length=5,
                                   one_pass=one_pass)
    assert in_training_mode["loss"].item() == in_eval_mode["loss"].item() != 0.0
