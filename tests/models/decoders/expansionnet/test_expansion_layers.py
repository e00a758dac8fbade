"""Static / block static / dynamic expansion against direct computations of the paper's equations
(explicit loops and the literal BroadSum matrices), plus slot counts, causality, padding and the
incremental state."""
import math

import pytest
import torch
import torch.nn.functional as F

import mplug_pretrain  # noqa: F401
from mplug_pretrain.models.decoders.expansionnet.layers import (
    DynamicExpansion,
    LayerCombination,
    StaticExpansion,
    normalize_rows,
    normalize_rows_per_group,
)

EPS = 1e-9


def reference_block_static(module: StaticExpansion, x, key_valid):
    """Eqs. 2-8 with block static backward: per-group Psi over each group's slots, scaled by 1/|G|."""
    b_size, length, d = x.shape
    eq, eb = module.query_vectors, module.bias_vectors
    out = torch.zeros_like(x)
    for b in range(b_size):
        k = module.key(x[b])
        values = [module.values[0](x[b]), module.values[1](x[b])]
        m = [[eq[n] @ k[s] / math.sqrt(d) for s in range(length)] for n in range(eq.shape[0])]
        streams = []
        for sign, v in zip((-1.0, 1.0), values):
            expanded = []
            for n in range(eq.shape[0]):
                r = [torch.relu(sign * m[n][s]) if key_valid[b, s] else torch.zeros(()) for s in range(length)]
                denom = sum(r) + EPS
                expanded.append(sum(r[s] / denom * v[s] for s in range(length)) + eb[n])
            rows = []
            for pos in range(length):
                acc, offset = torch.zeros(d, dtype=x.dtype), 0
                for size in module.group:
                    r = [torch.relu(sign * m[n][pos]) for n in range(offset, offset + size)]
                    denom = sum(r) + EPS
                    acc = acc + sum(r[j] / denom * expanded[offset + j] for j in range(size))
                    offset += size
                rows.append(acc / len(module.group))
            streams.append(torch.stack(rows))
        gate = torch.sigmoid(module.gate(x[b]))
        out[b] = gate * streams[0] + (1 - gate) * streams[1]
    return out


def reference_dynamic(module: DynamicExpansion, x, key_valid):
    """Eq. 1 with the literal 0/1 matrices H_E, I_E; masks built entry by entry."""
    b_size, length, d = x.shape
    n_e = module.slots
    h_e = torch.zeros(length, length * n_e, dtype=x.dtype)
    for t in range(length):
        h_e[t, t * n_e:(t + 1) * n_e] = 1
    i_e = torch.cat([torch.eye(n_e, dtype=x.dtype)] * length, dim=1)
    mask_fw = torch.zeros(b_size, length * n_e, length, dtype=x.dtype)
    mask_bw = torch.zeros(b_size, length, length * n_e, dtype=x.dtype)
    for b in range(b_size):
        for j in range(length * n_e):
            for s in range(length):
                slot_pos = j // n_e
                mask_fw[b, j, s] = float(bool(key_valid[b, s]) and (not module.causal or s <= slot_pos))
                mask_bw[b, s, j] = float(bool(key_valid[b, slot_pos]) and (not module.causal or slot_pos <= s))
    out = torch.zeros_like(x)
    for b in range(b_size):
        c = module.condition(x[b])
        q_e = (c.T @ h_e).T + (module.query_vectors.T @ i_e).T
        b_e = (c.T @ h_e).T + (module.bias_vectors.T @ i_e).T
        m = q_e @ module.key(x[b]).T / math.sqrt(d)
        streams = []
        for sign, value in zip((-1.0, 1.0), module.values):
            r_fw = torch.relu(sign * m) * mask_fw[b]
            f = r_fw / (r_fw.sum(-1, keepdim=True) + EPS) @ value(x[b]) + b_e
            r_bw = torch.relu(sign * m.T) * mask_bw[b]
            streams.append(r_bw / (r_bw.sum(-1, keepdim=True) + EPS) @ f)
        gate = torch.sigmoid(module.gate(x[b]))
        out[b] = gate * streams[0] + (1 - gate) * streams[1]
    return out


def test_block_static_matches_direct_per_group_computation():
    torch.manual_seed(0)
    module = StaticExpansion(8, (2, 3, 4)).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    key_valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(module(x, key_valid), reference_block_static(module, x, key_valid),
                               rtol=1e-10, atol=1e-10)


def test_block_normalisation_differs_from_one_global_normalisation():
    """Guards the reading |G| groups normalised separately (not one Psi over all slots)."""
    scores = torch.rand(3, 9)
    per_group = normalize_rows_per_group(scores, torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2]), 3)
    torch.testing.assert_close(per_group[:, :2].sum(-1), torch.ones(3))
    torch.testing.assert_close(per_group[:, 5:].sum(-1), torch.ones(3))
    assert not torch.allclose(per_group, normalize_rows(scores))


@pytest.mark.parametrize("causal", [True, False])
def test_dynamic_matches_literal_broadsum_and_masks(causal):
    torch.manual_seed(1)
    module = DynamicExpansion(6, 3, causal=causal).double().eval()
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    key_valid = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    y, _ = module(x, key_valid)
    torch.testing.assert_close(y, reference_dynamic(module, x, key_valid), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("length", [1, 3, 11])
def test_static_gives_sum_of_group_slots_whatever_the_length(length):
    x = torch.randn(2, length, 8)
    assert [f.shape for f in StaticExpansion(8, (5,)).expand(x)] == [(2, 5, 8)] * 2
    assert [f.shape for f in StaticExpansion(8, (2, 3, 4)).expand(x)] == [(2, 9, 8)] * 2
    assert StaticExpansion(8, (2, 3, 4))(x).shape == x.shape


@pytest.mark.parametrize("length", [1, 3, 11])
@pytest.mark.parametrize("causal", [True, False])
def test_dynamic_gives_length_times_slots(length, causal):
    x = torch.randn(2, length, 8)
    y, state = DynamicExpansion(8, 4, causal=causal)(x, torch.ones(2, length, dtype=torch.bool))
    assert y.shape == x.shape
    assert state.expanded_1.shape == state.expanded_2.shape == state.queries.shape == (2, length * 4, 8)


def test_causal_dynamic_expansion_is_causal():
    torch.manual_seed(2)
    module = DynamicExpansion(8, 4).eval()
    x = torch.randn(2, 9, 8)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(2, 4, 8)
    valid = torch.ones(2, 9, dtype=torch.bool)
    y, y2 = module(x, valid)[0], module(x2, valid)[0]
    torch.testing.assert_close(y[:, :5], y2[:, :5], rtol=0, atol=0)
    assert not torch.allclose(y[:, 5:], y2[:, 5:])


def test_bidirectional_dynamic_expansion_sees_the_future():
    torch.manual_seed(2)
    module = DynamicExpansion(8, 4, causal=False).eval()
    x = torch.randn(1, 6, 8)
    x2 = x.clone()
    x2[:, -1] += 1.0
    valid = torch.ones(1, 6, dtype=torch.bool)
    assert not torch.allclose(module(x, valid)[0][:, 0], module(x2, valid)[0][:, 0])


def test_incremental_state_equals_full_computation():
    torch.manual_seed(3)
    module = DynamicExpansion(8, 4).eval()
    x = torch.randn(2, 7, 8)
    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    full, full_state = module(x, valid)
    parts, state = [], None
    for start, stop in [(0, 3), (3, 4), (4, 5), (5, 7)]:
        y, state = module(x[:, start:stop], valid[:, :stop], state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)
    torch.testing.assert_close(state.expanded_1, full_state.expanded_1, rtol=0, atol=1e-5)


def test_padding_does_not_change_real_positions():
    torch.manual_seed(4)
    static = StaticExpansion(8, (3, 5)).eval()
    bidir = DynamicExpansion(8, 3, causal=False).eval()
    real = torch.randn(1, 4, 8)
    padded = torch.cat([real, torch.randn(1, 3, 8)], 1)
    valid = torch.tensor([[1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(static(padded, valid)[:, :4], static(real), rtol=0, atol=1e-6)
    torch.testing.assert_close(bidir(padded, valid)[0][:, :4], bidir(real, valid[:, :4])[0], rtol=0, atol=1e-6)
    # left padding in a causal layer: pad contents are invisible
    causal = DynamicExpansion(8, 3).eval()
    left = torch.cat([torch.randn(1, 2, 8), real], 1)
    left2 = left.clone()
    left2[:, :2] = torch.randn(1, 2, 8) * 5
    left_valid = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(causal(left, left_valid)[0][:, 2:], causal(left2, left_valid)[0][:, 2:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalisation_runs_in_fp32(dtype):
    scores = torch.tensor([[0.0, 0.0, 0.0], [1.0, 3.0, 0.0]], dtype=dtype)
    out = normalize_rows(scores)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0], [0.25, 0.75, 0.0]]))
    # what happens without it in fp16: eps underflows and the all-zero causal row becomes NaN
    assert torch.isnan(torch.tensor(0.0, dtype=torch.float16) / (torch.tensor(0.0, dtype=torch.float16) + EPS))


def test_layer_combination_is_sum_of_per_layer_projections():
    torch.manual_seed(5)
    combine = LayerCombination(6, 3).eval()
    ys = [torch.randn(2, 4, 6) for _ in range(3)]
    w = combine.project.weight
    summed = sum(y @ w[:, 6 * n:6 * (n + 1)].T for n, y in enumerate(ys)) + combine.project.bias
    expected = F.layer_norm(ys[-1] + summed, (6,), combine.norm.weight, combine.norm.bias)
    torch.testing.assert_close(combine(ys), expected)


def test_bad_groups_and_states_raise():
    with pytest.raises(ValueError, match="expansion group"):
        StaticExpansion(8, (4, 0))
    with pytest.raises(ValueError, match="expansion_slots"):
        DynamicExpansion(8, 0)
    bidir = DynamicExpansion(8, 2, causal=False)
    _, state = bidir(torch.randn(1, 2, 8), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal"):
        bidir(torch.randn(1, 1, 8), torch.ones(1, 3, dtype=torch.bool), state)


def test_static_forward_dropout_comes_after_the_biases():
    """Official order: F_i = Dropout(R_fw V_i + B_E). Every entry of F in train mode is therefore 0 or
    (R_fw V + B_E) / (1 - p); with the bias added after dropout a dropped entry would equal B_E instead."""
    torch.manual_seed(3)
    p = 0.5
    module = StaticExpansion(6, (4,), dropout=p)
    module.score_dropout.p = 0.0  # keep M deterministic; only the forward-product dropout is under test
    x = torch.randn(2, 5, 6)
    d = x.shape[-1]
    m = module.query_vectors @ module.key(x).transpose(-1, -2) / math.sqrt(d)  # [B, N_E, L]
    module.train()
    expanded = module.expand(x)
    for sign, value, got in zip((-1.0, 1.0), module.values, expanded):
        r = torch.relu(sign * m)
        full = r / (r.sum(-1, keepdim=True) + EPS) @ value(x) + module.bias_vectors
        kept = (got - full / (1 - p)).abs() <= 1e-5
        dropped = got.abs() <= 1e-12
        assert bool((kept | dropped).all())
        assert kept.any() and dropped.any()
