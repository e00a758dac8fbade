"""tasks/caption/sampled_cider.py: the held-out mean CIDEr-D of sampled captions equals a hand computation (same draws,
EOS appended by hand, scored by CiderD in "none" mode with df from the held-out references)."""
import numpy as np
import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
from mplug_pretrain.metrics.cider_d import CiderD
from mplug_pretrain.models.generation.decoding import sample
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.tasks.caption.sampled_cider import sampled_cider_d
from mplug_pretrain.tasks.caption.scst import decode_samples
from mplug_pretrain.tasks.caption.text import clean_caption

K, MAX_LENGTH, SEED = 3, 6, 4


def _batches(refs):
    torch.manual_seed(0)
    images = torch.randn(3, 3, 64, 64)
    return [{"image": images[:2], "image_id": torch.tensor([3, 5]), "captions": [refs[3], refs[5]],
             "is_pad": torch.tensor([False, False])},
            {"image": torch.cat([images[2:], images[:1]]), "image_id": torch.tensor([8, 3]),
             "captions": [refs[8], refs[3]], "is_pad": torch.tensor([False, True])}]


def _hand_samples(model, tokenizer):
    """The same draws as sampled_cider_d: one generator seeded SEED * 1000 (rank 0), batches in order."""
    generator = torch.Generator().manual_seed(SEED * 1000)
    ids, mask = tokenize(tokenizer, ["a picture of"], 512)
    texts, finished = [], []
    with torch.no_grad():
        for batch, n in zip(_batches({3: [], 5: [], 8: []}), (2, 1)):
            memory, memory_mask = model.memory(batch["image"][:n], ids.expand(n, -1), mask.expand(n, -1))
            sequences, _ = sample(model.decoder, memory, memory_mask, num_samples=K, max_length=MAX_LENGTH,
                                  generator=generator)
            t, f = decode_samples(tokenizer, sequences)
            texts += t
            finished += f
    return texts, finished


def test_sampled_cider_d_equals_a_hand_computation():
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    torch.manual_seed(1)
    model = build_model("tiny", **{"heads.use_momentum": False}).eval()
    texts, finished = _hand_samples(model, tokenizer)
    # references that share words with some samples, so the scores are not all zero
    refs = {3: [texts[0], "a red circle on the left"], 5: [texts[4] + " and more", "two shapes"], 8: [texts[8]]}
    got = sampled_cider_d(model, _batches(refs), tokenizer, "a picture of", torch.device("cpu"), k=K,
                          max_length=MAX_LENGTH, seed=SEED)

    hyps = [clean_caption(t) + (" <eos>" if f else "") for t, f in zip(texts, finished)]
    rows = np.repeat([0, 1, 2], K)
    corpus = [[clean_caption(r) + " <eos>" for r in refs[i]] for i in (3, 5, 8)]
    expected = CiderD(corpus, eos_mode="none").score(hyps, rows, df="fixed")
    assert got == pytest.approx(expected.mean(), abs=1e-12)
    assert got > 0.5 and expected.min() < expected.max()
    with pytest.raises(ValueError, match="no real image"):
        sampled_cider_d(model, [{**_batches(refs)[1], "is_pad": torch.tensor([True, True])}], tokenizer,
                        "a picture of", torch.device("cpu"))
