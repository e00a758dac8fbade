"""ITC / ITM / MLM / PrefixLM heads against independent (loop-based) computations, queues, momentum update."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID, MASK_ID, PAD_ID
from mplug_pretrain.models.heads.itc import ImageTextContrastive
from mplug_pretrain.models.heads.itm import ImageTextMatchingHead, sample_hard_negatives
from mplug_pretrain.models.heads.lm_head import LMPredictionHead
from mplug_pretrain.models.heads.mlm import SPECIAL_IDS, mask_tokens, mlm_loss
from mplug_pretrain.models.heads.prefix_lm import prefix_lm_loss, split_prefix


# ----------------------------------------------------------------------------- ITC
def reference_itc(fv, fl, fvm, flm, image_queue, text_queue, queue_ids, ids, temp, alpha):
    """Row-by-row ALBEF ITC in float64 with Python loops."""
    b = fv.shape[0]
    text_cols = [flm[j] for j in range(b)] + [text_queue[:, q] for q in range(text_queue.shape[1])]
    image_cols = [fvm[j] for j in range(b)] + [image_queue[:, q] for q in range(image_queue.shape[1])]
    all_ids = list(ids) + list(queue_ids)

    def direction(queries, queries_m, cols):
        total = 0.0
        for i in range(b):
            logits = [float(queries[i].double() @ c.double()) / temp for c in cols]
            lse = math.log(sum(math.exp(x) for x in logits))
            pos = [1.0 if all_ids[j] == ids[i] else 0.0 for j in range(len(cols))]
            target = [p / sum(pos) for p in pos]
            if alpha:
                m_logits = [float(queries_m[i].double() @ c.double()) / temp for c in cols]
                m_lse = math.log(sum(math.exp(x) for x in m_logits))
                target = [alpha * math.exp(x - m_lse) + (1 - alpha) * y for x, y in zip(m_logits, target)]
            total += -sum(y * (x - lse) for x, y in zip(logits, target))
        return total / b

    return (direction(fv, fvm, text_cols) + direction(fl, flm, image_cols)) / 2


def unit(*shape, seed):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_itc_loss_matches_reference_with_queue_and_ids(alpha):
    itc = ImageTextContrastive(width=8, embed_dim=6, temperature=0.07, queue_size=10, momentum=True)
    itc.enqueue(unit(7, 6, seed=1), unit(7, 6, seed=2), torch.tensor([5, 6, 7, 8, 1, 9, 10]))  # 7 of 10 slots
    fv, fl, fvm, flm = (unit(4, 6, seed=s) for s in (3, 4, 5, 6))
    ids = torch.tensor([1, 2, 1, 3])  # ids 1 repeat in the batch and in the queue
    got = itc.loss(fv, fl, fvm, flm, ids, alpha)
    valid = int(itc.queue_count)
    expected = reference_itc(fv, fl, fvm, flm, itc.image_queue[:, :valid], itc.text_queue[:, :valid],
                             itc.idx_queue[:valid].tolist(), ids.tolist(), 0.07, alpha)
    assert valid == 7
    assert abs(got.item() - expected) < 1e-4


def test_itc_without_ids_uses_the_diagonal():
    itc = ImageTextContrastive(width=8, embed_dim=6, temperature=0.1, queue_size=4, momentum=False)
    fv, fl = unit(3, 6, seed=1), unit(3, 6, seed=2)
    got = itc.loss(fv, fl, fv, fl, None, 0.0)
    logits = fv @ fl.t() / 0.1
    expected = (F.cross_entropy(logits, torch.arange(3)) + F.cross_entropy(logits.t(), torch.arange(3))) / 2
    assert torch.allclose(got, expected, atol=1e-5)


def test_queue_wraps_around_with_batches_not_dividing_its_size():
    q = 10
    itc = ImageTextContrastive(width=4, embed_dim=3, temperature=0.07, queue_size=q, momentum=False)
    pushed = []  # (global index, id)
    for step, n in enumerate([4, 4, 3, 13, 2]):
        feats = torch.arange(len(pushed), len(pushed) + n, dtype=torch.float32)[:, None].repeat(1, 3)
        ids = torch.arange(len(pushed), len(pushed) + n) + 100
        itc.enqueue(feats, feats, ids)
        pushed += list(range(len(pushed), len(pushed) + n))
        latest = {}
        for g in pushed:  # reference ring buffer: slot g % q holds the newest item written there
            latest[g % q] = g
        assert int(itc.queue_count) == min(q, len(pushed))
        assert int(itc.queue_ptr) == len(pushed) % q
        for slot, g in latest.items():
            assert itc.image_queue[0, slot].item() == g and itc.idx_queue[slot].item() == g + 100


# ----------------------------------------------------------------------------- ITM
def test_hard_negatives_never_share_the_anchor_id():
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    for seed in range(50):
        sim = torch.randn(7, 7, generator=torch.Generator().manual_seed(seed)) * 20
        neg = sample_hard_negatives(sim, ids, generator=torch.Generator().manual_seed(seed))
        assert bool(neg.text_valid.all()) and bool(neg.image_valid.all())
        assert not bool((ids[neg.image_for_text] == ids).any())
        assert not bool((ids[neg.text_for_image] == ids).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hard_negatives_with_equal_similarities_and_degenerate_batches(dtype):
    neg = sample_hard_negatives(torch.zeros(5, 5, dtype=dtype))
    assert not bool((neg.image_for_text == torch.arange(5)).any())
    huge = torch.full((4, 4), -1e4, dtype=dtype).fill_diagonal_(1e4)  # softmax mass only on the diagonal
    neg = sample_hard_negatives(huge)
    assert not bool((neg.text_for_image == torch.arange(4)).any())
    same = sample_hard_negatives(torch.randn(3, 3), torch.tensor([7, 7, 7]))  # one image, three captions
    assert not bool(same.text_valid.any()) and not bool(same.image_valid.any())
    one = sample_hard_negatives(torch.randn(1, 1))
    assert not bool(one.text_valid.any())


def test_hard_negatives_follow_the_similarities():
    sim = torch.zeros(4, 4)
    sim[0, 2] = sim[1, 3] = sim[2, 0] = sim[3, 1] = 30.0  # hardest text for image i
    neg = sample_hard_negatives(sim, generator=torch.Generator().manual_seed(0))
    assert neg.text_for_image.tolist() == [2, 3, 0, 1]
    assert neg.image_for_text.tolist() == [2, 3, 0, 1]  # sim^T has the same hardest pairs


def test_itm_loss_is_cross_entropy_of_linear_head():
    torch.manual_seed(0)
    head = ImageTextMatchingHead(8)
    cls, labels = torch.randn(6, 8), torch.tensor([1, 1, 0, 0, 0, 0])
    logits = cls @ head.linear.weight.t() + head.linear.bias
    expected = -torch.stack([logits[i].log_softmax(0)[labels[i]] for i in range(6)]).mean()
    assert torch.allclose(head.loss(cls, labels), expected, atol=1e-6)


# ----------------------------------------------------------------------------- MLM
def test_mask_tokens_statistics_and_specials(text_batch):
    ids, mask = text_batch(64, 128, seed=3, min_len=20)
    ids[:, 5] = 100  # [UNK] must never be masked either
    masked, labels = mask_tokens(ids, mask, 30522, 0.15, generator=torch.Generator().manual_seed(0))
    selected = labels != -100
    special = torch.isin(ids, torch.tensor(SPECIAL_IDS)) | (mask == 0)
    assert not bool((selected & special).any())
    assert torch.equal(masked[special], ids[special])
    assert torch.equal(labels[selected], ids[selected])
    maskable = (~special).sum().item()
    assert abs(selected.sum().item() / maskable - 0.15) < 0.02
    n = selected.sum().item()
    to_mask = (masked[selected] == MASK_ID).sum().item() / n
    unchanged = (masked[selected] == ids[selected]).sum().item() / n
    assert abs(to_mask - 0.8) < 0.04 and abs(unchanged - 0.1) < 0.03 and abs(1 - to_mask - unchanged - 0.1) < 0.03
    assert torch.equal(masked[~selected], ids[~selected])


def test_mlm_loss_matches_full_logits_cross_entropy():
    torch.manual_seed(0)
    head, emb = LMPredictionHead(16, 50), torch.randn(50, 16)
    hidden = torch.randn(2, 5, 16)
    labels = torch.full((2, 5), -100)
    labels[0, 1], labels[1, 3], labels[1, 4] = 7, 0, 49
    logits = head(hidden, emb)
    picks = [(0, 1), (1, 3), (1, 4)]
    expected = -sum(logits[b, t].log_softmax(0)[labels[b, t]] for b, t in picks) / 3
    assert torch.allclose(mlm_loss(head, hidden, labels, emb), expected, atol=1e-5)
    nothing = mlm_loss(head, hidden, torch.full((2, 5), -100), emb)
    assert nothing.item() == 0.0 and nothing.requires_grad


# ----------------------------------------------------------------------------- PrefixLM
def test_prefix_split_rule(text_batch):
    ids, mask = text_batch(32, 12, seed=5, min_len=2)  # includes empty captions ([CLS] [SEP])
    n = mask.sum(1) - 2
    for seed in range(10):
        split = split_prefix(ids, mask, prefix_min_tokens=2, generator=torch.Generator().manual_seed(seed))
        for b in range(32):
            k, nb = int(split.prefix_tokens[b]), int(n[b])
            prefix = split.prefix_ids[b][split.prefix_mask[b].bool()].tolist()
            target = split.target_ids[b][split.target_mask[b].bool()].tolist()
            assert prefix[0] == BOS_ID and prefix[-1] == EOS_ID and len(prefix) == k + 2
            assert target[0] == BOS_ID and target[-1] == EOS_ID
            assert prefix[1:-1] + target[1:-1] == ids[b, 1:nb + 1].tolist()
            if nb >= 1:
                assert len(target) - 2 >= 1  # at least one caption token to predict
            if nb - 1 >= 2:
                assert k >= 2
            assert bool((split.prefix_ids[b][~split.prefix_mask[b].bool()] == PAD_ID).all())


def test_prefix_split_fixed_and_layout_errors(text_batch):
    ids, mask = text_batch(3, 10, min_len=6)
    split = split_prefix(ids, mask, split=torch.tensor(3))
    assert split.prefix_ids[:, 1:4].tolist() == ids[:, 1:4].tolist() and bool((split.prefix_ids[:, 4] == EOS_ID).all())
    assert split.target_ids[:, 1].tolist() == ids[:, 4].tolist()
    with pytest.raises(ValueError, match="CLS"):
        split_prefix(ids[:, 1:], mask[:, 1:])
    with pytest.raises(ValueError, match="longer"):
        split_prefix(ids, mask, split=torch.tensor(20))


def test_prefix_lm_loss_matches_token_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11)
    target = torch.tensor([[BOS_ID % 11, 3, 4, 2], [BOS_ID % 11, 5, 0, 0]])
    target_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    terms = [logits[b, t].log_softmax(0)[target[b, t + 1]] for b in range(2) for t in range(3)
             if target_mask[b, t + 1]]
    assert torch.allclose(prefix_lm_loss(logits, target, target_mask), -sum(terms) / len(terms), atol=1e-6)


# ----------------------------------------------------------------------------- momentum
def test_momentum_update_formula():
    from mplug_pretrain.models.presets import build_model
    torch.manual_seed(0)
    model = build_model("tiny", **{"heads.momentum": 0.9})
    with torch.no_grad():
        for p in model.text_encoder.parameters():
            p.add_(torch.randn_like(p))
    online = {k: v.clone() for k, v in model.text_encoder.state_dict().items()}
    before = {k: v.clone() for k, v in model.text_encoder_m.state_dict().items()}
    proj_online, proj_before = model.itc.vision_proj.weight.clone(), model.itc.vision_proj_m.weight.clone()
    model.momentum_update()
    for key, value in model.text_encoder_m.state_dict().items():
        assert torch.allclose(value, 0.9 * before[key] + 0.1 * online[key], atol=1e-6)
    assert torch.allclose(model.itc.vision_proj_m.weight, 0.9 * proj_before + 0.1 * proj_online, atol=1e-6)
    assert not any(p.requires_grad for p in model.text_encoder_m.parameters())
