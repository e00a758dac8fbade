"""ACF clustering matrices against brute-force loops over Eqs. 2-3 and 7, their properties, the
causal incremental rows, Down-Up sampling, stacking (Eq. 5) and clustered attention (Eq. 1)."""
import math

import pytest
import torch
import torch.nn.functional as F

import mplug_pretrain  # noqa: F401
from mplug_pretrain.models.decoders.acf.clustering import (
    ClusteredSelfAttention,
    ClusterEstimator1D,
    ClusterEstimator2D,
    stack_clusters,
)


def brute_force_1d(fc, s):
    """C_ij = prod_{k=i+1..j} sigmoid(FC([s_k, mean(s_i..s_{k-1})])), C_ii = 1, C_ji = C_ij."""
    n = s.shape[0]
    c = torch.eye(n, dtype=s.dtype)
    for i in range(n):
        for j in range(i + 1, n):
            prob = torch.ones((), dtype=s.dtype)
            for k in range(i + 1, j + 1):
                prob = prob * torch.sigmoid(fc(torch.cat([s[k], s[i:k].mean(0)])))[0]
            c[i, j] = c[j, i] = prob
    return c


def brute_force_2d(horizontal, vertical, grid):
    h, w, _ = grid.shape
    c_h = [brute_force_1d(horizontal.fc, grid[x]) for x in range(h)]
    c_v = [brute_force_1d(vertical.fc, grid[:, i]) for i in range(w)]
    c = torch.zeros(h * w, h * w, dtype=grid.dtype)
    for x in range(h):
        for i in range(w):
            for y in range(h):
                for j in range(w):
                    c[x * w + i, y * w + j] = c_h[min(x, y)][i, j] * c_v[min(i, j)][x, y]
    return c


@pytest.fixture(scope="module")
def estimator():
    torch.manual_seed(0)
    return ClusterEstimator1D(5).double()


def test_1d_matrix_matches_brute_force(estimator):
    s = torch.randn(2, 7, 5, dtype=torch.float64)
    c = estimator(s)
    for b in range(2):
        torch.testing.assert_close(c[b], brute_force_1d(estimator.fc, s[b]), rtol=1e-10, atol=1e-12)


def test_1d_matrix_properties(estimator):
    c = estimator(torch.randn(3, 9, 5, dtype=torch.float64))
    torch.testing.assert_close(c, c.transpose(-1, -2), rtol=0, atol=0)
    torch.testing.assert_close(torch.diagonal(c, dim1=-2, dim2=-1), torch.ones(3, 9, dtype=torch.float64))
    assert (c >= 0).all() and (c <= 1).all()
    decays = c[..., 1:] <= c[..., :-1] + 1e-12  # entry [i, j - 1]: C_ij <= C_i,j-1 (Eq. 4)
    beyond_diagonal = torch.arange(8)[None, :] >= torch.arange(9)[:, None]  # j > i
    assert decays[:, beyond_diagonal].all()


def test_causal_rows_in_chunks_equal_the_full_matrix(estimator):
    s = torch.randn(2, 8, 5, dtype=torch.float64)
    full = torch.tril(estimator(s))
    rows, state = [], None
    for start, stop in [(0, 3), (3, 4), (4, 7), (7, 8)]:
        r, state, _ = estimator.causal_rows(s[:, start:stop], state)
        rows.append(F.pad(r, (0, 8 - stop)))
    torch.testing.assert_close(torch.cat(rows, 1), full, rtol=1e-12, atol=1e-12)


def test_2d_matrix_matches_brute_force_and_grid_neighbours():
    torch.manual_seed(1)
    est = ClusterEstimator2D(4).double()
    grid = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    c = est(grid)
    assert c.shape == (2, 12, 12)
    torch.testing.assert_close(c[1], brute_force_2d(est.horizontal, est.vertical, grid[1]), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(c, c.transpose(-1, -2), rtol=0, atol=0)
    torch.testing.assert_close(torch.diagonal(c, dim1=-2, dim2=-1), torch.ones(2, 12, dtype=torch.float64))
    assert (c >= 0).all() and (c <= 1).all()
    v = grid[0]
    x, i = 1, 2
    right = torch.sigmoid(est.horizontal.fc(torch.cat([v[x, i + 1], v[x, i]])))[0]  # Eq. 3 with a one-element span
    down = torch.sigmoid(est.vertical.fc(torch.cat([v[x + 1, i], v[x, i]])))[0]
    p = x * 4 + i
    torch.testing.assert_close(c[0, p, p + 1], right)
    torch.testing.assert_close(c[0, p, p + 4], down)
    assert c[0, 0, 1] >= c[0, 0, 2] >= c[0, 0, 3]  # decays along a grid row
    assert c[0, 0, 4] >= c[0, 0, 8]  # and down a grid column


def test_down_up_sampling_replicates_the_pooled_grid_matrix():
    torch.manual_seed(2)
    est = ClusterEstimator2D(4, down_up_rate=2).double()
    grid = torch.randn(1, 4, 6, 4, dtype=torch.float64)
    pooled = grid.reshape(1, 2, 2, 3, 2, 4).mean(dim=(2, 4))  # 2x2 average pooling -> [1, 2, 3, 4]
    coarse = brute_force_2d(est.horizontal, est.vertical, pooled[0])
    c = est(grid)[0]
    for p in range(24):
        for q in range(24):
            cp = (p // 6 // 2) * 3 + (p % 6) // 2
            cq = (q // 6 // 2) * 3 + (q % 6) // 2
            assert torch.isclose(c[p, q], coarse[cp, cq], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="down_up_rate"):
        est(torch.randn(1, 3, 4, 4, dtype=torch.float64))


def test_stacking_grows_monotonically_and_stays_in_unit_interval():
    torch.manual_seed(3)
    prior = None
    layers = [ClusterEstimator2D(4) for _ in range(4)]
    grid = torch.randn(2, 3, 3, 4)
    for est in layers:
        current = est(grid)
        stacked = stack_clusters(current, prior)
        torch.testing.assert_close(stacked, current if prior is None else current + prior - current * prior)
        if prior is not None:
            assert (stacked >= prior - 1e-7).all()
        assert (stacked <= 1 + 1e-7).all()
        prior = stacked
        grid = grid + 0.5 * torch.randn_like(grid)


def test_clustered_attention_matches_direct_formula():
    torch.manual_seed(4)
    attention = ClusteredSelfAttention(8, 2, dropout=0.0).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    clusters = ClusterEstimator1D(8).double()(x)
    allowed = torch.tril(torch.ones(5, 5, dtype=torch.bool)).expand(2, 5, 5)
    y, _ = attention(x, clusters, allowed)
    w_q, w_k, w_v = attention.qkv.weight.split(8)
    b_q, b_k, b_v = attention.qkv.bias.split(8)
    heads = []
    for h in range(2):
        sl = slice(4 * h, 4 * h + 4)
        q, k, v = x @ w_q[sl].T + b_q[sl], x @ w_k[sl].T + b_k[sl], x @ w_v[sl].T + b_v[sl]
        scores = (q @ k.transpose(-1, -2) / math.sqrt(4)).masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(scores, -1) * clusters @ v)  # Eq. 1: post-softmax product, no renormalisation
    torch.testing.assert_close(y, attention.out(torch.cat(heads, -1)), rtol=1e-10, atol=1e-12)


def test_clustering_runs_in_fp32_under_autocast():
    torch.manual_seed(5)
    est = ClusterEstimator1D(6)
    x = torch.randn(1, 12, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = est(x)
    assert c.dtype == torch.float32
    torch.testing.assert_close(c, est(x))

