"""Fan-out math (docs/algorithm.md §4): exact integer optimum, closed form, and the online α / r estimators."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hf_ssd.core.fanout import (
    R_MAX,
    R_MIN,
    AcceptanceEstimator,
    FanoutPlanner,
    MissRateEstimator,
    acceptance_pmf,
    continuous_fanout,
    expected_hit_rate,
    geometric_fanout,
)


def compositions(n: int, parts: int):
    """All tuples of `parts` non-negative ints summing to n."""
    for cuts in itertools.combinations(range(n + parts - 1), parts - 1):
        bounds = (-1, *cuts, n + parts - 1)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(parts))


def brute_force(budget: int, alpha: float, r: float, K: int, c: float) -> float:
    return max(expected_hit_rate(F, alpha, r, top1_miss=c) for F in compositions(budget, K + 1))


@pytest.mark.parametrize("K", [0, 1, 2, 3])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.97, 1.0])
@pytest.mark.parametrize("r", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("c", [1.0, 0.6, 0.1])
def test_integer_allocation_is_exact_optimum(K, alpha, r, c):
    for budget in range(0, 10):
        F = geometric_fanout(budget, alpha, r, K, top1_miss=c)
        assert len(F) == K + 1 and all(isinstance(f, int) and f >= 0 for f in F)
        assert sum(F) == budget
        got = expected_hit_rate(F, alpha, r, top1_miss=c)
        assert got == pytest.approx(brute_force(budget, alpha, r, K, c), abs=1e-12), (budget, F)


def test_greedy_alone_would_not_be_exact():
    # With c = 1, F = 1 is worth nothing: 8 branches over 8 positions must not be [1]*8 (hit rate 0).
    F = geometric_fanout(8, 0.8, 1.0, 7)
    assert expected_hit_rate(F, 0.8, 1.0) > 0.3
    assert 1 not in F


def test_sums_to_budget_random_and_edges():
    rng = np.random.default_rng(0)
    for _ in range(300):
        K = int(rng.integers(0, 12))
        budget = int(rng.integers(0, 80))
        alpha = float(rng.uniform(-0.2, 1.2))
        r = float(rng.uniform(-1.0, 4.0))
        F = geometric_fanout(budget, alpha, r, K, top1_miss=float(rng.uniform(0, 1)))
        assert sum(F) == budget and len(F) == K + 1 and min(F) >= 0
    assert geometric_fanout(0, 0.7, 1.0, 5) == [0] * 6
    assert sum(geometric_fanout(3, 0.7, 1.0, 7)) == 3  # budget < K+1: some positions get 0
    assert geometric_fanout(5, 0.7, 1.0, 0) == [5]
    with pytest.raises(ValueError):
        geometric_fanout(-1, 0.7, 1.0, 3)
    with pytest.raises(ValueError):
        geometric_fanout(4, 0.7, 1.0, -1)


def test_r_nonpositive_is_clamped():
    assert geometric_fanout(40, 0.7, 0.0, 4) == geometric_fanout(40, 0.7, R_MIN, 4)
    assert geometric_fanout(40, 0.7, -3.0, 4) == geometric_fanout(40, 0.7, R_MIN, 4)


def test_monotone_in_k_before_cap():
    for alpha, r in [(0.5, 1.0), (0.8, 0.5), (0.9, 2.0)]:
        F = geometric_fanout(60, alpha, r, 7)
        assert all(F[k] >= F[k + 1] for k in range(6)), F


def test_continuous_closed_form():
    alpha, r, K, B = 0.8, 1.0, 7, 24
    F = continuous_fanout(B, alpha, r, K)
    assert sum(F) == pytest.approx(B)
    for k in range(K):  # docs/algorithm.md §4: F_k = F_0·α^(k/(1+r)), F_K = F_0·α^(K/(1+r))·(1-α)^(-1/(1+r))
        assert F[k] == pytest.approx(F[0] * alpha ** (k / (1 + r)))
    assert F[K] == pytest.approx(F[0] * alpha ** (K / (1 + r)) * (1 - alpha) ** (-1 / (1 + r)))


@pytest.mark.parametrize("alpha,r,K", [(0.6, 0.7, 5), (0.85, 1.5, 7), (0.95, 1.0, 10)])
def test_integer_close_to_continuous_for_large_budgets(alpha, r, K):
    B = 5000
    F = geometric_fanout(B, alpha, r, K)
    Fc = continuous_fanout(B, alpha, r, K)
    assert max(abs(f - fc) / fc for f, fc in zip(F, Fc)) < 0.01
    assert expected_hit_rate(F, alpha, r) >= expected_hit_rate([round(x) for x in Fc], alpha, r) - 1e-12


def test_expected_hit_rate_by_hand():
    # P = [0.5, 0.5]; h(2) = 1 - 1/2, h(1) = 0
    assert expected_hit_rate([2, 1], 0.5, 1.0) == pytest.approx(0.25)
    # c = 0.5: h(1) = 0.5, h(4) = 1 - 0.5/4 (r = 1); P = [0.5, 0.5]
    assert expected_hit_rate([1, 4], 0.5, 1.0, top1_miss=0.5) == pytest.approx(0.5 * 0.5 + 0.5 * 0.875)
    assert sum(acceptance_pmf(0.73, 6)) == pytest.approx(1.0)


def capped_geometric(rng: np.random.Generator, alpha: float, K: int, n: int) -> np.ndarray:
    trials = rng.random((n, K)) < alpha
    return np.where(trials.all(1), K, np.argmin(trials, axis=1))  # index of the first rejection = accepted count


@pytest.mark.parametrize("alpha", [0.6, 0.85])
def test_acceptance_estimator_recovers_alpha(alpha):
    rng = np.random.default_rng(1)
    est = AcceptanceEstimator(prior=0.3)
    assert est.value == pytest.approx(0.3)  # prior before data
    for k in capped_geometric(rng, alpha, 7, 20_000):
        est.update(int(k), 7)
    assert est.value == pytest.approx(alpha, abs=0.01)


def test_acceptance_estimator_window_tracks_drift_and_expected_updates():
    rng = np.random.default_rng(2)
    est = AcceptanceEstimator(window=500)
    for k in capped_geometric(rng, 0.5, 5, 5000):
        est.update(int(k), 5)
    assert est.value == pytest.approx(0.5, abs=0.04)
    for k in capped_geometric(rng, 0.9, 5, 5000):
        est.update(int(k), 5)
    assert est.value == pytest.approx(0.9, abs=0.03)
    exp = AcceptanceEstimator(prior=0.2, prior_weight=1.0)
    for _ in range(1000):
        exp.update_expected([0.7, 0.8, 0.9])
    assert exp.value == pytest.approx(0.8, abs=0.002)
    with pytest.raises(ValueError):
        est.update(6, 5)


def power_law_ranks(rng: np.random.Generator, r: float, n: int) -> np.ndarray:
    # P(rank >= F) = P(U^(-1/r) >= F) = F^(-r) for integer F >= 1
    return np.floor(rng.random(n) ** (-1.0 / r)).astype(int)


@pytest.mark.parametrize("r", [0.7, 1.5])
def test_miss_rate_estimator_recovers_r(r):
    rng = np.random.default_rng(3)
    est = MissRateEstimator(prior_r=3.0)
    assert est.value == pytest.approx(3.0) and est.top1_miss == pytest.approx(1.0)
    for rank in power_law_ranks(rng, r, 20_000):
        est.update(int(rank))
    assert est.value == pytest.approx(r, abs=0.05)
    assert est.top1_miss == pytest.approx(1.0, abs=0.03)
    miss, _ = est.miss_rates()
    assert miss[3] == pytest.approx(4.0 ** -r, rel=0.05)


def test_miss_rate_estimator_unbiased_under_censoring():
    # Only "not in the first F offered" is known on a miss; F varies per lookup. Kaplan-Meier keeps r unbiased.
    rng = np.random.default_rng(4)
    r, c = 1.0, 0.5
    est = MissRateEstimator()
    for _ in range(20_000):
        rank = 0 if rng.random() < 1 - c else int(np.floor(rng.random() ** (-1.0 / r)))  # P(rank>=F) = c F^-r
        limit = int(rng.integers(1, 12))
        est.update(rank if rank < limit else None, limit)
    assert est.value == pytest.approx(r, abs=0.08)
    assert est.top1_miss == pytest.approx(c, abs=0.05)


def test_miss_rate_estimator_learns_a_first_guess_that_never_misses():
    # every bonus of rank 0: no miss rate to fit a slope to, but the top-1 miss rate itself is ~0, not the prior's 1
    est = MissRateEstimator(prior_r=1.5)
    for _ in range(400):
        est.update(0)
    r, c = est.fit()
    assert r == pytest.approx(1.5) and c < 0.06


def test_miss_rate_estimator_counts_equal_one_by_one_updates():
    rng = np.random.default_rng(6)
    ranks = power_law_ranks(rng, 1.0, 300)
    one, many = MissRateEstimator(), MissRateEstimator()
    for rank in ranks:
        one.update(int(rank))
    many.update_counts(np.bincount(np.minimum(ranks, 16), minlength=17).tolist())
    assert many.n == one.n and many.fit() == pytest.approx(one.fit())
    # with a window, a batch of N counts ages what came before by N observations
    aged = MissRateEstimator(window=100.0)
    aged.update_counts([10] + [0] * 16)
    aged.update_counts([0] * 16 + [50])
    assert aged.n == pytest.approx(10 * 0.99**50 + 50)


def test_miss_rate_estimator_clamps():
    est = MissRateEstimator(prior_weight=0.0)
    for i in range(5000):
        est.update(1 if i % 2 else 2)  # miss rate collapses to 0 beyond F = 2: a huge slope
    assert R_MIN <= est.value <= R_MAX


def test_planner_overrides_and_estimates():
    p = FanoutPlanner(24, 7, fanout=[3] * 8)
    assert p.schedule(True) == [3] * 8 and p.schedule(False) == [3] * 8
    with pytest.raises(ValueError):
        FanoutPlanner(24, 7, fanout=[3] * 7)
    p = FanoutPlanner(24, 7, alpha=(0.9, 0.3), r=1.0)
    assert p.schedule(True) == geometric_fanout(24, 0.9, 1.0, 7)
    assert p.schedule(False) == geometric_fanout(24, 0.3, 1.0, 7)
    assert p.schedule(True) != p.schedule(False)

    p = FanoutPlanner(24, 7)
    assert sum(p.schedule(True)) == 24 and sum(p.schedule(False)) == 24  # priors before data
    rng = np.random.default_rng(5)
    for k, rank in zip(capped_geometric(rng, 0.85, 7, 5000), power_law_ranks(rng, 1.5, 5000)):
        p.observe(True, int(k), 7, int(rank))
    assert p.hit.alpha.value == pytest.approx(0.85, abs=0.02)
    assert p.hit.miss.value == pytest.approx(1.5, abs=0.1)
    assert p.schedule(True) == geometric_fanout(24, round(p.hit.alpha.value, 3), round(p.hit.miss.value, 2), 7,
                                                top1_miss=round(p.hit.miss.top1_miss, 2))
    assert p.miss.alpha.n == 0  # after-miss estimators untouched
    assert math.isclose(sum(p.schedule(False)), 24)
