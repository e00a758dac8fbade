"""ACF formula="official" against independent computations written from the official code's formulas
(ZihuaEvan/ACFModel, GroupAttention_one_dim / MultiHeadedAttention): a scalar pure-Python evaluation on a
hand-picked input, a tensor re-statement of the official steps (mean-matrix bmm, cumprod, triu, symmetrise,
unit diagonal) on random inputs, layer stacking on merge probabilities, the attention output with the
official q/k/v/out projections mapped in, and the 2-D estimator with one shared FC. fp32, <= 1e-5."""
import math

import pytest
import torch

import mplug_pretrain  # noqa: F401
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.models.decoders.acf.clustering import (
    ClusteredSelfAttention,
    ClusterEstimator1D,
    ClusterEstimator2D,
)
from mplug_pretrain.models.decoders.acf.decoder import ACFDecoder
from mplug_pretrain.models.decoders.acf.encoder import ACFVisualRefiner
from mplug_pretrain.models.model_config import DecoderConfig, VisualRefinerConfig

TOL = {"rtol": 1e-5, "atol": 1e-5}


def scalar_official_1d(tokens, fc_w, fc_b, ln_w, ln_b, prior=None):
    """Pure-Python floats: LN (unbiased std, eps on std), M_ik = sigmoid(FC([s_k, mean(s_i..s_k)])) for k >= i,
    M~ = prior + (1 - prior) M, C_ij = prod_{k=i..j} M~_ik (j > i), C_ii = 1, symmetric. Returns (C, M~)."""
    d = len(tokens[0])
    normed = []
    for s in tokens:
        mean = sum(s) / d
        std = math.sqrt(sum((v - mean) ** 2 for v in s) / (d - 1))
        normed.append([ln_w[c] * (s[c] - mean) / (std + 1e-6) + ln_b[c] for c in range(d)])
    n = len(tokens)
    merge = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for k in range(i, n):
            span = [sum(normed[m][c] for m in range(i, k + 1)) / (k - i + 1) for c in range(d)]
            z = sum(fc_w[c] * normed[k][c] for c in range(d)) + sum(fc_w[d + c] * span[c] for c in range(d)) + fc_b
            p = 1.0 / (1.0 + math.exp(-z))
            merge[i][k] = p if prior is None else prior[i][k] + (1.0 - prior[i][k]) * p
    c = [[1.0 if i == j else 0.0 for j in range(n)] for i in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            c[i][j] = c[j][i] = math.prod(merge[i][k] for k in range(i, j + 1))
    return c, merge


def official_layer_norm(x, w, b):
    return w * (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6) + b


def tensor_official_1d(x, fc, ln_w, ln_b, prior=0.0):
    """The official GroupAttention_one_dim steps as tensor operations: x [B, N, d] -> (C, M~) [B, N, N]."""
    b, n, d = x.shape
    ctx = x if ln_w is None else official_layer_norm(x, ln_w, ln_b)
    mean_matrix = torch.zeros(n, n, n)  # [i, p, q] = 1/(q - i + 1) for i <= p <= q
    for i in range(n):
        size = n - i
        mean_matrix[i, i:, i:] = torch.triu(torch.ones(size, size)) / torch.arange(1, size + 1)
    span_mean = torch.einsum("bpd,ipq->biqd", ctx, mean_matrix)  # [B, i, k, d]
    current = ctx[:, None].expand(b, n, n, d).masked_fill(span_mean == 0, 0.0)
    merge = torch.sigmoid(fc(torch.cat([current, span_mean], -1)))[..., 0]  # [B, i, k]
    merge = prior + (1.0 - prior) * merge
    g = torch.cumprod(merge.masked_fill(torch.triu(torch.ones(n, n)) == 0, 1.0), dim=2)
    g = torch.triu(g)
    g = g + g.transpose(1, 2)
    g = g - torch.diag_embed(torch.diagonal(g, dim1=-1, dim2=-2) - 1)
    return g, merge


def randomise_norm(est: ClusterEstimator1D | ClusterEstimator2D, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        est.norm.weight.copy_(1 + 0.3 * torch.randn(est.norm.weight.shape, generator=g))
        est.norm.bias.copy_(0.2 * torch.randn(est.norm.bias.shape, generator=g))


def test_hand_picked_input_matches_scalar_official_formula():
    est = ClusterEstimator1D(3, "official")
    fc_w, fc_b = [0.8, -0.5, 0.3, 1.1, 0.4, -0.9], 0.2
    ln_w, ln_b = [1.0, 0.5, 2.0], [0.1, 0.0, -0.2]
    with torch.no_grad():
        est.fc.weight.copy_(torch.tensor([fc_w]))
        est.fc.bias.fill_(fc_b)
        est.norm.weight.copy_(torch.tensor(ln_w))
        est.norm.bias.copy_(torch.tensor(ln_b))
    tokens = [[1.0, 0.0, 2.0], [0.0, 1.0, -1.0], [2.0, 2.0, 0.5], [-1.0, 0.5, 0.0]]
    expected, merges = scalar_official_1d(tokens, fc_w, fc_b, ln_w, ln_b)
    c, m = est(torch.tensor([tokens]), return_merges=True)
    torch.testing.assert_close(c[0], torch.tensor(expected), **TOL)
    upper = torch.triu(torch.ones(4, 4, dtype=torch.bool))
    torch.testing.assert_close(m[0][upper], torch.tensor(merges)[upper], **TOL)
    # a second layer stacks on the first layer's merge probabilities (d), not on its matrix
    expected2, _ = scalar_official_1d(tokens[::-1], fc_w, fc_b, ln_w, ln_b, prior=merges)
    c2 = est(torch.tensor([tokens[::-1]]), merge_prior=m)
    torch.testing.assert_close(c2[0], torch.tensor(expected2), **TOL)


def test_official_differs_from_paper_on_the_same_weights():
    torch.manual_seed(0)
    official = ClusterEstimator1D(4, "official")
    paper = ClusterEstimator1D(4)
    paper.fc.load_state_dict(official.fc.state_dict())
    x = torch.randn(1, 6, 4)
    assert (official(x) - paper(x)).abs().max() > 1e-2


def test_random_inputs_match_the_official_tensor_steps_with_stacking():
    torch.manual_seed(1)
    layers = [ClusterEstimator1D(8, "official") for _ in range(3)]
    for n, est in enumerate(layers):
        randomise_norm(est, n)
    x = torch.randn(2, 7, 8)
    prior_ref, prior_ours = 0.0, None
    for est in layers:
        expected, merge_ref = tensor_official_1d(x, est.fc, est.norm.weight, est.norm.bias, prior_ref)
        c, merges = est(x, merge_prior=prior_ours, return_merges=True)
        torch.testing.assert_close(c, expected, **TOL)
        prior_ref, prior_ours = merge_ref, merges
        x = x + 0.5 * torch.randn_like(x)


def test_causal_rows_in_chunks_equal_the_official_full_matrix_with_prior():
    torch.manual_seed(2)
    first, second = ClusterEstimator1D(5, "official"), ClusterEstimator1D(5, "official")
    x = torch.randn(2, 8, 5)
    _, full_prior = first(x, return_merges=True)
    full = torch.tril(second(x, merge_prior=full_prior))
    rows, state_1, state_2 = [], None, None
    for start, stop in [(0, 3), (3, 4), (4, 8)]:
        _, state_1, merges = first.causal_rows(x[:, start:stop], state_1)
        r, state_2, _ = second.causal_rows(x[:, start:stop], state_2, merges)
        rows.append(torch.nn.functional.pad(r, (0, 8 - stop)))
    torch.testing.assert_close(torch.cat(rows, 1), full, **TOL)


def official_attention(x, linears, heads, group_prob, mask):
    """Official MultiHeadedAttention with group_prob: masked (mask | diag) -> -1e9, softmax, * C, @ V."""
    b, n, d = x.shape
    q, k, v = (lin(x).view(b, n, heads, d // heads).transpose(1, 2) for lin in linears[:3])
    scores = q @ k.transpose(-2, -1) / math.sqrt(d // heads)
    allowed = mask.long() | torch.eye(n, dtype=torch.long)
    scores = scores.masked_fill(allowed[:, None] == 0, -1e9)
    attn = torch.softmax(scores, -1) * group_prob[:, None]
    return linears[3]((attn @ v).transpose(1, 2).reshape(b, n, d))


def test_attention_output_with_official_weights_mapped_in():
    torch.manual_seed(3)
    d, heads = 16, 4
    linears = [torch.nn.Linear(d, d) for _ in range(4)]  # official: q, k, v, out
    est = ClusterEstimator1D(d, "official")
    randomise_norm(est, 7)
    x = torch.randn(2, 6, d)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.long)).expand(2, 6, 6)
    group_prob, _ = tensor_official_1d(x, est.fc, est.norm.weight, est.norm.bias)
    expected = official_attention(x, linears, heads, group_prob, causal)
    ours = ClusteredSelfAttention(d, heads, dropout=0.0).eval()
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([lin.weight for lin in linears[:3]]))
        ours.qkv.bias.copy_(torch.cat([lin.bias for lin in linears[:3]]))
        ours.out.load_state_dict(linears[3].state_dict())
    y, _ = ours(x, est(x), causal.bool())
    torch.testing.assert_close(y, expected, **TOL)


def test_2d_official_uses_one_shared_fc_and_the_official_1d_per_direction():
    torch.manual_seed(4)
    est = ClusterEstimator2D(6, down_up_rate=2, formula="official")
    randomise_norm(est, 3)
    assert sum(1 for name, _ in est.named_parameters() if name.endswith("fc.weight")) == 1
    grid = torch.randn(2, 4, 6, 6)
    normed = official_layer_norm(grid, est.norm.weight, est.norm.bias)
    pooled = normed.reshape(2, 2, 2, 3, 2, 6).mean(dim=(2, 4))  # [B, 2, 3, d]
    no_norm = (None, None)  # the 2-D estimator normalises once, before pooling
    layer_priors = [None, None]
    for _ in range(2):  # two stacked layers share weights here; only the merge prior flows
        c_h, m_h = zip(*[tensor_official_1d(pooled[:, x], est.shared.fc, *no_norm,
                                            0.0 if layer_priors[0] is None else layer_priors[0][x])
                         for x in range(2)])
        c_v, m_v = zip(*[tensor_official_1d(pooled[:, :, i], est.shared.fc, *no_norm,
                                            0.0 if layer_priors[1] is None else layer_priors[1][i])
                         for i in range(3)])
        coarse = torch.zeros(2, 6, 6)
        for x in range(2):
            for i in range(3):
                for y in range(2):
                    for j in range(3):
                        coarse[:, x * 3 + i, y * 3 + j] = c_h[min(x, y)][:, i, j] * c_v[min(i, j)][:, x, y]
        index = torch.tensor([(r // 2) * 3 + c // 2 for r in range(4) for c in range(6)])
        expected = coarse[:, index][:, :, index]
        prior = None if layer_priors[0] is None else (torch.stack(layer_priors[0], 1), torch.stack(layer_priors[1], 1))
        c, _ = est(grid, prior, return_merges=True)
        torch.testing.assert_close(c, expected, **TOL)
        layer_priors = [list(m_h), list(m_v)]


def test_official_refiner_runs_and_both_modules_validate_the_field():
    """(The official decoder keeps the decoder_api contract: tests/models/decoders/test_decoder_contract.py.)"""
    torch.manual_seed(5)
    refiner = ACFVisualRefiner(VisualRefinerConfig(type="acf", layers=2, acf_formula="official"), 8, 2, heads=2)
    out, clusters = refiner(torch.randn(2, 5, 8), return_clusters=True)
    assert out.shape == (2, 5, 8) and len(clusters) == 2
    with pytest.raises(ConfigError, match="decoder.acf_formula"):
        ACFDecoder(DecoderConfig(type="acf", layers=1, heads=2, ffn_dim=8, acf_formula="offical"), 30, 8)
    with pytest.raises(ConfigError, match="refiner.acf_formula"):
        ACFVisualRefiner(VisualRefinerConfig(type="acf", layers=1, acf_formula="x"), 8, 2, heads=2)


def test_config_field_is_validated_by_name():
    from mplug_pretrain.config import config_from_dict
    cfg = config_from_dict({"model": {"decoder": {"type": "acf", "acf_formula": "official"},
                                      "refiner": {"type": "acf", "acf_formula": "official"}}}, check_paths=False)
    assert cfg.model.decoder.acf_formula == cfg.model.refiner.acf_formula == "official"
    assert config_from_dict({}, check_paths=False).model.decoder.acf_formula == "paper"
    with pytest.raises(ConfigError, match="model.refiner.acf_formula"):
        config_from_dict({"model": {"refiner": {"acf_formula": "offical"}}}, check_paths=False)


def test_official_refiner_trains_and_stays_finite_under_bf16_autocast():
    torch.manual_seed(6)
    refiner = ACFVisualRefiner(VisualRefinerConfig(type="acf", layers=2, acf_formula="official"), 8, 2, heads=2)
    refiner(torch.randn(2, 5, 8)).square().mean().backward()
    for name, p in refiner.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = refiner.eval()(torch.randn(2, 5, 8))
    assert torch.isfinite(out.float()).all()
