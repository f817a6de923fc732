"""The verification math, checked by exact enumeration instead of sampling.

verify_sampled draws u ~ U(0,1) per slot and one token from the residual. Here `acceptance_uniforms` is replaced by a grid
of midpoints u_m = (m + 1/2)/M and `sample` by a recorder of the residual it was handed, so the output
distribution is computed exactly: with dyadic q (powers of two) and p on a 1/64 grid every ratio p/q is a multiple
of 1/M, so the fraction of grid points with u*q < p is exactly min(1, p/q) (no ties, no rounding).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import hf_ssd.core.verify as verify_mod
from hf_ssd.core.sampling import point_mass, saguaro_probs
from hf_ssd.core.verify import draft_slots, leading_true, verify_greedy, verify_sampled

V = 4
M = 64  # u grid; 1/M divides every p/q below (p on the 1/64 grid, q dyadic >= 1/8)


# ---- greedy ---------------------------------------------------------------------------------------------------------
def test_leading_true_and_slots():
    ok = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert leading_true(ok).tolist() == [2, 0, 4]
    assert draft_slots(torch.tensor([0, 2, 4]), 4).tolist() == [
        [False] * 4, [True, True, False, False], [True] * 4]


def test_verify_greedy_cases():
    # scores[b, i] has argmax choice[b][i]
    choice = torch.tensor([[1, 2, 3, 0], [1, 2, 3, 0], [1, 2, 3, 0], [1, 2, 3, 0]])
    scores = torch.nn.functional.one_hot(choice, V).float() * 5 + torch.randn(4, 4, V) * 0.1
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [3, 2, 3], [1, 2, 3]])
    n = torch.tensor([3, 3, 3, 1])
    out = verify_greedy(drafts, n, scores)
    # all accepted -> bonus from the K+1-th position; mismatch at slot 1 -> bonus = argmax there; n limits acceptance
    assert out.accepted.tolist() == [3, 1, 0, 1]
    assert out.bonus.tolist() == [0, 2, 1, 2]


# ---- exact enumeration helpers --------------------------------------------------------------------------------------
def _patched_run(monkeypatch, drafts, n, p, q, u):
    """verify_sampled with fixed u [B, K]; returns (accepted [B], residual distribution [B, V])."""
    seen = {}

    def fake_rand(B, K, generator=None, device=None, dtype=None):
        assert (B, K) == tuple(u.shape)
        return u.to(dtype=dtype or torch.float32)

    def fake_sample(probs, generator=None):
        seen["probs"] = probs.clone()
        return probs.argmax(dim=-1)

    monkeypatch.setattr(verify_mod, "acceptance_uniforms", fake_rand)
    monkeypatch.setattr(verify_mod, "sample", fake_sample)
    try:
        out = verify_sampled(drafts, n, p, q)
    finally:
        monkeypatch.undo()
    return out.accepted, seen["probs"]


def _dyadic_q(g: torch.Generator) -> torch.Tensor:
    """A distribution over V=4 tokens with power-of-two probabilities (1/2, 1/4, 1/8, 1/8), randomly permuted."""
    base = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    return base[torch.randperm(V, generator=g)]


def _grid_p(g: torch.Generator) -> torch.Tensor:
    """A distribution with every probability a positive multiple of 1/64."""
    cut = torch.sort(torch.randperm(63, generator=g)[: V - 1] + 1).values
    counts = torch.diff(torch.cat([torch.tensor([0]), cut, torch.tensor([64])])).double()
    return counts / 64


def _u_grid(K: int) -> torch.Tensor:
    mids = (torch.arange(M, dtype=torch.float64) + 0.5) / M
    return torch.cartesian_prod(*[mids] * K).reshape(-1, K) if K > 1 else mids[:, None]


def output_distribution_k2(monkeypatch, p1, p2_given, q1, q2_given, n_drafts=2):
    """Exact joint distribution of the first two emitted tokens for K=2, extending a 1-token output with the true
    next-token distribution p2(. | y1). p2_given[x1] and q2_given[x1] condition on the first draft."""
    K = 2
    u = _u_grid(K)  # [M^2, 2]
    rows_d, rows_p, rows_q, rows_w = [], [], [], []
    for x1, x2 in itertools.product(range(V), range(V)):
        w = float(q1[x1] * q2_given[x1][x2])
        if w == 0:
            continue
        rows_d.append(torch.tensor([x1, x2]))
        rows_p.append(torch.stack([p1, p2_given[x1], torch.full((V,), 1.0 / V, dtype=torch.float64)]))
        rows_q.append(torch.stack([q1, q2_given[x1]]))
        rows_w.append(w)
    D = len(rows_d)
    drafts = torch.stack(rows_d).repeat_interleave(u.shape[0], 0)
    p = torch.stack(rows_p).repeat_interleave(u.shape[0], 0)
    q = torch.stack(rows_q).repeat_interleave(u.shape[0], 0)
    weights = torch.tensor(rows_w, dtype=torch.float64).repeat_interleave(u.shape[0]) / u.shape[0]
    uu = u.repeat(D, 1)
    n = torch.full((drafts.shape[0],), n_drafts)
    k, residual = _patched_run(monkeypatch, drafts, n, p, q, uu)
    P2 = torch.stack(p2_given)  # [V, V]: row y1 = p2(. | y1)
    joint = torch.zeros(V, V, dtype=torch.float64)
    k0, k1, k2 = k == 0, k == 1, k >= 2
    # k = 0: y1 ~ residual, y2 ~ true p2(. | y1)
    joint += (weights[k0, None] * residual[k0]).sum(0)[:, None] * P2
    # k = 1: y1 = x1, y2 ~ residual at slot 2
    joint.index_add_(0, drafts[k1, 0], weights[k1, None] * residual[k1])
    # k = 2: y1, y2 = x1, x2 (the bonus is past the two tokens compared)
    joint.view(-1).index_add_(0, drafts[k2, 0] * V + drafts[k2, 1], weights[k2])
    return joint


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    p1 = _grid_p(g)
    p2 = [_grid_p(g) for _ in range(V)]
    q1 = _dyadic_q(g)
    q2 = [_dyadic_q(g) for _ in range(V)]
    return p1, p2, q1, q2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_sampled_output_is_p_exactly(monkeypatch, seed):
    p1, p2, q1, q2 = _setup(seed)
    joint = output_distribution_k2(monkeypatch, p1, p2, q1, q2)
    expected = p1[:, None] * torch.stack(p2)
    torch.testing.assert_close(joint, expected, atol=1e-12, rtol=0)


def test_verify_sampled_with_fewer_real_drafts(monkeypatch):
    """n=1 < K=2: slot 2 is never accepted and the bonus after an accepted d_1 comes from p2 itself."""
    p1, p2, q1, q2 = _setup(3)
    joint = output_distribution_k2(monkeypatch, p1, p2, q1, q2, n_drafts=1)
    torch.testing.assert_close(joint, p1[:, None] * torch.stack(p2), atol=1e-12, rtol=0)


def test_point_mass_proposal_is_exact(monkeypatch):
    """A deterministic proposal x verified with q = one-hot(x): accept with p(x), residual = p without x."""
    p1, p2, _, _ = _setup(5)
    for x1 in range(V):
        for x2 in range(V):
            q1 = point_mass(torch.tensor(x1), V, torch.float64)
            q2 = [point_mass(torch.tensor(x2), V, torch.float64)] * V
            joint = output_distribution_k2(monkeypatch, p1, p2, q1, q2)
            torch.testing.assert_close(joint, p1[:, None] * torch.stack(p2), atol=1e-12, rtol=0)


def test_wrong_q_is_detected(monkeypatch):
    """Negative control: verifying drafts drawn from q against a different q' must not reproduce p."""
    p1, p2, q1, q2 = _setup(0)
    joint_true = output_distribution_k2(monkeypatch, p1, p2, q1, q2)
    # drafts drawn from q, but verified as if drawn from a point mass on argmax q (greedy matching at T > 0)
    q1_wrong = point_mass(q1.argmax(), V, torch.float64)
    # enumerate by hand for one position: P(y) = sum_x q(x) [1{y=x} a(x) + (1 - a(x)) r_x(y)] with the wrong q'
    k_dist = torch.zeros(V, dtype=torch.float64)
    u = _u_grid(1)
    for x in range(V):
        drafts = torch.full((M, 1), x)
        p = torch.stack([p1, p1]).expand(M, 2, V).clone()
        q = q1_wrong.expand(M, 1, V).clone()
        k, residual = _patched_run(monkeypatch, drafts, torch.ones(M, dtype=torch.long), p, q, u)
        for i in range(M):
            if k[i] == 1:
                k_dist[x] += q1[x] / M
            else:
                k_dist += q1[x] / M * residual[i]
    assert (k_dist - p1).abs().max() > 1e-2
    torch.testing.assert_close(joint_true.sum(1), p1, atol=1e-12, rtol=0)


def test_acceptance_threshold_is_min_one_ratio():
    """u just below p/q accepts, just above rejects; u*q < p is the rule (never u < p alone)."""
    g = torch.Generator().manual_seed(0)
    B, K = 64, 3
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = torch.randint(0, V, (B, K), generator=g)
    ratio = (p[:, :K].gather(2, drafts[..., None]) / q.gather(2, drafts[..., None])).squeeze(2)[:, 0]
    below, above = ratio < 0.99, ratio > 1.0
    assert below.any() and above.any()
    n = torch.ones(B, dtype=torch.long)  # one real draft: slots 1.. are never accepted
    for factor, expect in ((0.999, 1), (1.001, 0)):
        u = (ratio * factor).clamp(max=0.999999)[:, None].expand(B, K).contiguous()
        orig = verify_mod.acceptance_uniforms
        verify_mod.acceptance_uniforms = lambda *s: u.to(s[-1])
        try:
            out = verify_sampled(drafts, n, p, q)
        finally:
            verify_mod.acceptance_uniforms = orig
        assert (out.accepted[below] == expect).all()
        assert (out.accepted[above] == 1).all()  # p >= q: always accepted
        assert (out.accepted <= 1).all()


def test_verify_sampled_residual_zero_mass_rows():
    """p == q at a rejected slot has an all-zero residual (probability 0 event): must fall back to p, not NaN."""
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]])
    orig = verify_mod.acceptance_uniforms
    verify_mod.acceptance_uniforms = lambda *s: torch.ones(1, 1, dtype=s[-1])
    try:
        out = verify_sampled(torch.tensor([[0]]), torch.tensor([1]), p, q, torch.Generator().manual_seed(0))
    finally:
        verify_mod.acceptance_uniforms = orig
    assert out.accepted.item() == 0 and out.bonus.item() in (0, 1)


# ---- sampling helpers ----------------------------------------------------------------------------------------------
def test_point_mass():
    q = point_mass(torch.tensor([[2, 0]]), 5)
    assert q.shape == (1, 2, 5)
    assert q[0, 0].tolist() == [0, 0, 1, 0, 0] and q[0, 1].tolist() == [1, 0, 0, 0, 0]


def test_saguaro_probs_c1_is_softmax():
    z = torch.randn(3, 7)
    torch.testing.assert_close(saguaro_probs(z, 3, 1.0), torch.softmax(z, -1))


def test_saguaro_probs_downweights_top_f():
    z = torch.tensor([[3.0, 1.0, 2.0, 0.0, float("-inf")]])
    p = torch.softmax(z, -1)[0]
    C, F = 0.3, 2
    w = torch.ones(5)
    w[[0, 2]] = C  # top-2 of z are tokens 0 and 2
    expected = p * w / (p * w).sum()
    out = saguaro_probs(z, F, C)[0]
    torch.testing.assert_close(out, expected)
    assert out[4] == 0  # -inf stays impossible


def test_saguaro_probs_per_row_fanout_and_edge_cases():
    z = torch.randn(4, 6)
    F = torch.tensor([0, 1, 3, 6])
    out = saguaro_probs(z, F, 0.5)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(out[0], p[0])  # F = 0: plain softmax
    for r in (1, 2):
        top = p[r].topk(int(F[r])).indices
        w = torch.ones(6)
        w[top] = 0.5
        torch.testing.assert_close(out[r], p[r] * w / (p[r] * w).sum())
    torch.testing.assert_close(out[3], p[3])  # all tokens down-weighted equally: unchanged
    # C = 0 with all mass in the top-F: sigma undefined -> plain softmax, never NaN
    z0 = torch.tensor([[0.0, 0.0, float("-inf")]])
    torch.testing.assert_close(saguaro_probs(z0, 2, 0.0), torch.softmax(z0, -1))
    # C = 0 otherwise: top-F removed entirely
    z1 = torch.tensor([[2.0, 1.0, 0.0]])
    out1 = saguaro_probs(z1, 1, 0.0)[0]
    assert out1[0] == 0 and torch.isclose(out1.sum(), torch.tensor(1.0))


def test_sample_inverse_cdf_is_exact():
    """sample(): the right frequencies (a 1% shift would fail at this size), zero-mass tokens never drawn,
    unnormalised rows accepted, and a fixed generator reproduces the draws."""
    from scipy.stats import chisquare

    from hf_ssd.core.sampling import sample

    p = torch.tensor([0.1, 0.0, 0.3, 0.6, 0.0])
    n = 400_000
    draws = sample((p * 7.0).expand(n, 5), torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    observed = counts[[0, 2, 3]].double().numpy()
    exact = [0.1, 0.3, 0.6]
    assert chisquare(observed, [x * n for x in exact]).pvalue > 1e-3
    biased = [0.11, 0.29, 0.6]  # 1 point of mass moved
    assert chisquare(observed, [x * n for x in biased]).pvalue < 1e-6
    again = sample((p * 7.0).expand(n, 5), torch.Generator().manual_seed(1))
    assert torch.equal(draws, again)
