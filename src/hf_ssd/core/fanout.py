"""Geometric fan-out (docs/algorithm.md §4): how many bonus-token guesses to cache for each number k of accepted
drafts.

Model: k ~ capped geometric, P(k) = (1-α)α^k for k < K and P(K) = α^K; the true bonus lies outside the draft's
top-F guesses with probability c·F^(-r) (the paper's law has c = 1). We choose integers F_0..F_K with Σ F_k = B
maximising the hit probability Σ_k P(k)·h(F_k), where h(F) = 1 - c·F^(-r) for F ≥ 1 and h(0) = 0.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

ALPHA_EPS = 1e-6
R_MIN, R_MAX = 0.05, 5.0
RANK_FMAX = 16  # bonus ranks are told apart up to here; a rank at or past it counts as "not in the first 16"


def _clamp_alpha(alpha: float) -> float:
    if math.isnan(alpha):
        raise ValueError("alpha is NaN")
    return min(max(float(alpha), ALPHA_EPS), 1.0 - ALPHA_EPS)  # α=0 or 1 makes P(k) degenerate


def acceptance_pmf(alpha: float, K: int) -> list[float]:
    """P(k accepted drafts), k = 0..K, under the capped geometric."""
    a = _clamp_alpha(alpha)
    return [(1.0 - a) * a**k for k in range(K)] + [a**K]


def _hit(F: int, r: float, c: float) -> float:
    return 0.0 if F <= 0 else 1.0 - c * F ** (-r)


def expected_hit_rate(fanout: Sequence[int], alpha: float, r: float, *, top1_miss: float = 1.0) -> float:
    """Σ_k P(k)·h(F_k): probability that the verification outcome is in the cache (K = len(fanout) - 1)."""
    P = acceptance_pmf(alpha, len(fanout) - 1)
    return sum(p * _hit(F, r, top1_miss) for p, F in zip(P, fanout))


def continuous_fanout(budget: float, alpha: float, r: float, K: int) -> list[float]:
    """Closed-form real optimum F_k = B·P(k)^(1/(1+r)) / Σ_j P(j)^(1/(1+r)) (independent of c)."""
    r = max(float(r), R_MIN)
    w = [p ** (1.0 / (1.0 + r)) for p in acceptance_pmf(alpha, K)]
    s = sum(w)
    return [budget * x / s for x in w]


def _greedy(P: list[float], active: list[int], budget: int, r: float, c: float) -> list[int]:
    """Exact optimum when every active position gets F ≥ 1: h is concave on F ≥ 1, so marginal-gain greedy is exact."""
    F = [0] * len(P)
    heap = []
    for k in active:
        F[k] = 1
        heap.append((-P[k] * c * (1.0 - 2.0 ** (-r)), k))  # gain of F: 1 -> 2; ties -> smaller k
    heapq.heapify(heap)
    for _ in range(budget - len(active)):
        _, k = heapq.heappop(heap)
        F[k] += 1
        f = F[k]
        heapq.heappush(heap, (-P[k] * c * (f ** (-r) - (f + 1) ** (-r)), k))
    return F


def geometric_fanout(budget: int, alpha: float, r: float, K: int, *, top1_miss: float = 1.0) -> list[int]:
    """Exact integer fan-out F_0..F_K (Σ = budget) maximising the cache-hit probability.

    h is concave only on F ≥ 1 (the step 0 -> 1 gains just 1 - c, which is 0 in the paper's law), so plain greedy is
    not exact. All positions share h and differ only in weight P(k), so for m active positions (F ≥ 1) the best
    choice is the m most probable ones (exchange argument); we run the concave greedy for every m and keep the best.
    r ≤ R_MIN is clamped to R_MIN (r ≤ 0 would mean guesses never help; the r -> 0 limit is F ∝ P).
    """
    if K < 0 or budget < 0:
        raise ValueError(f"need K >= 0 and budget >= 0, got K={K}, budget={budget}")
    return list(_fanout(int(budget), _clamp_alpha(alpha), max(float(r), R_MIN), int(K),
                        min(max(float(top1_miss), 0.0), 1.0)))


@lru_cache(maxsize=1024)
def _fanout(budget: int, alpha: float, r: float, K: int, c: float) -> tuple[int, ...]:
    P = acceptance_pmf(alpha, K)
    order = sorted(range(K + 1), key=lambda k: -P[k])  # stable: equal P -> smaller k first
    best, best_val = [0] * (K + 1), -math.inf
    for m in range(1, min(K + 1, budget) + 1):
        F = _greedy(P, order[:m], budget, r, c)
        val = sum(p * _hit(f, r, c) for p, f in zip(P, F))
        if val >= best_val - 1e-15:  # on (numerical) ties spread over more positions
            best, best_val = F, max(val, best_val)
    return tuple(best)


class AcceptanceEstimator:
    """Online α. Each drafted position verified is a Bernoulli trial; under the capped geometric the MLE is
    α = Σ accepted / (Σ accepted + #rounds with a rejection). Prior = `prior_weight` pseudo-trials at rate `prior`;
    `window` (in observations) turns the sums into exponential moving averages so α can track drift."""

    def __init__(self, prior: float = 0.7, prior_weight: float = 2.0, window: float | None = None):
        a = _clamp_alpha(prior)
        self._acc, self._rej = prior_weight * a, prior_weight * (1.0 - a)
        self._decay = 1.0 - 1.0 / window if window else 1.0
        self.n = 0

    def _add(self, acc: float, rej: float) -> None:
        self._acc = self._decay * self._acc + acc
        self._rej = self._decay * self._rej + rej
        self.n += 1

    def update(self, accepted: int, drafted: int) -> None:
        """One round of one row: `accepted` of `drafted` drafts accepted (a rejection happened iff accepted < drafted)."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}, {drafted}")
        self._add(float(accepted), float(accepted < drafted))

    def update_expected(self, expected_accept_prob: float | Sequence[float]) -> None:
        """Rao-Blackwellised update: β = E[accept] = Σ_x min(p(x), q(x)) per position, counted as a fractional trial."""
        probs = [expected_accept_prob] if isinstance(expected_accept_prob, (int, float)) else expected_accept_prob
        for b in probs:
            b = min(max(float(b), 0.0), 1.0)
            self._add(b, 1.0 - b)

    @property
    def value(self) -> float:
        return _clamp_alpha(self._acc / (self._acc + self._rej))


class MissRateEstimator:
    """Online fit of 1 - p_hit(F) = c·F^(-r) from the rank of the true bonus among the draft's guesses.

    One rank tells hit/miss for every F (rank < F is a hit). The rank must be among the guesses as offered (the
    rejected draft token excluded). If only "not in the first `limit` guesses" is known (censored), pass rank=None:
    miss rates are then Kaplan-Meier estimates, which stay unbiased under such censoring. r and c come from least
    squares (weighted) of log miss(F) on log F over F = 1..fmax where at least `min_at_risk` observations remain, clamped to
    [R_MIN, R_MAX] and (0, 1], and shrunk towards the priors by prior_weight / (n + prior_weight)."""

    def __init__(self, fmax: int = RANK_FMAX, prior_r: float = 1.0, prior_top1_miss: float = 1.0,
                 prior_weight: float = 20.0, min_at_risk: float = 10.0, window: float | None = None):
        if fmax < 2:
            raise ValueError("fmax must be >= 2 to fit a slope")
        self.fmax, self.prior_r, self.prior_c = fmax, prior_r, prior_top1_miss
        self.prior_weight, self.min_at_risk = prior_weight, min_at_risk
        self._decay = 1.0 - 1.0 / window if window else 1.0
        self._exact = np.zeros(fmax)  # [j]: observations with rank == j
        self._cens = np.zeros(fmax + 1)  # [c]: observations known only as rank >= c (rank >= fmax lands in [fmax])

    def update(self, rank: int | None, limit: int | None = None) -> None:
        """`rank`: 0-based rank of the true bonus, or None if it was not among the first `limit` (default fmax)."""
        self._exact *= self._decay
        self._cens *= self._decay
        if rank is None:
            self._cens[min(self.fmax if limit is None else int(limit), self.fmax)] += 1.0
        elif rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        elif rank < self.fmax:
            self._exact[rank] += 1.0
        else:
            self._cens[self.fmax] += 1.0

    def update_counts(self, counts: Sequence[float]) -> None:
        """Many exact ranks at once: counts[j] bonus tokens of rank j (j < fmax), counts[fmax] of rank >= fmax."""
        if len(counts) != self.fmax + 1:
            raise ValueError(f"need {self.fmax + 1} counts (ranks 0..{self.fmax - 1}, then >= {self.fmax})")
        self._exact *= self._decay ** float(sum(counts))
        self._cens *= self._decay ** float(sum(counts))
        self._exact += np.asarray(counts[:self.fmax], dtype=float)
        self._cens[self.fmax] += float(counts[self.fmax])

    @property
    def n(self) -> float:
        return float(self._exact.sum() + self._cens[1:].sum())

    def miss_rates(self) -> tuple[np.ndarray, np.ndarray]:
        """(miss[F-1] = P(rank >= F), at_risk[F-1]) for F = 1..fmax (Kaplan-Meier)."""
        at_risk = np.cumsum(self._exact[::-1])[::-1] + np.cumsum(self._cens[::-1])[::-1][1:]
        hazard = np.divide(self._exact, at_risk, out=np.zeros_like(at_risk), where=at_risk > 0)
        return np.cumprod(1.0 - hazard), at_risk

    def fit(self) -> tuple[float, float]:
        """(r, c) after shrinkage towards the priors."""
        miss, at_risk = self.miss_rates()
        ok = (at_risk >= self.min_at_risk) & (miss > 0)
        if ok.sum() >= 2:
            x = np.log(np.arange(1, self.fmax + 1))[ok]
            # weights ∝ sqrt(at risk): the tail points rest on few observations
            slope, intercept = np.polyfit(x, np.log(miss[ok]), 1, w=np.sqrt(at_risk[ok]))
            r = float(np.clip(-slope, R_MIN, R_MAX))
            c = float(np.clip(math.exp(intercept), 1e-3, 1.0))
        elif at_risk[0] >= self.min_at_risk:
            # no slope to fit: the bonus was (nearly) always the top guess, or never below the second. The top-1
            # miss rate alone still says c (half an observation keeps it off 0); r stays the prior's. Falling back
            # to the prior here priced a draft whose every bonus was its first guess (α = 1) as missing half the
            # time, and made large speculation caches look worth their cost.
            r, c = self.prior_r, float(np.clip(max(miss[0], 0.5 / (at_risk[0] + 1.0)), 1e-3, 1.0))
        else:
            return self.prior_r, self.prior_c
        w = self.n / (self.n + self.prior_weight)
        return w * r + (1 - w) * self.prior_r, w * c + (1 - w) * self.prior_c

    @property
    def value(self) -> float:
        return self.fit()[0]

    @property
    def top1_miss(self) -> float:
        return self.fit()[1]


@dataclass
class ProposalStats:
    """Estimators for one proposal source (primary draft after a hit, backup after a miss)."""
    alpha: AcceptanceEstimator
    miss: MissRateEstimator


def _pair(x: float | tuple[float, float] | None) -> tuple[float | None, float | None]:
    return x if isinstance(x, tuple) else (x, x)


# α before any round is observed: after a hit (the primary draft proposed) and after a miss (a backup did)
PRIOR_ALPHA = (0.7, 0.4)


class FanoutPlanner:
    """Fan-out schedules for the two cases of docs/algorithm.md §4: after a hit the next proposal comes from the
    primary draft, after a miss from the backup (different α, hence a different schedule). User overrides win over
    estimates: `alpha` / `r` fix a value (or a (after_hit, after_miss) pair); `fanout` / `fanout_after_miss` fix the
    lists (`fanout` alone is used for both). A fixed r uses the paper's law (c = 1)."""

    def __init__(self, budget: int, K: int, *, alpha: float | tuple[float, float] | None = None,
                 r: float | tuple[float, float] | None = None, fanout: Sequence[int] | None = None,
                 fanout_after_miss: Sequence[int] | None = None, prior_alpha: tuple[float, float] = PRIOR_ALPHA,
                 window: float | None = None, fmax: int = RANK_FMAX):
        if budget < 0 or K < 0:
            raise ValueError(f"need budget >= 0 and K >= 0, got {budget}, {K}")
        self.budget, self.K = budget, K
        self.alpha, self.r = _pair(alpha), _pair(r)
        fanout_after_miss = fanout if fanout_after_miss is None else fanout_after_miss
        self.fixed = (self._check(fanout), self._check(fanout_after_miss))
        self.hit, self.miss = (ProposalStats(AcceptanceEstimator(a, window=window), MissRateEstimator(fmax, window=window))
                               for a in prior_alpha)

    def _check(self, fanout: Sequence[int] | None) -> list[int] | None:
        if fanout is None:
            return None
        if len(fanout) != self.K + 1 or any(int(f) != f or f < 0 for f in fanout):
            raise ValueError(f"fanout must be K+1={self.K + 1} non-negative ints, got {list(fanout)}")
        return [int(f) for f in fanout]

    def stats(self, after_hit: bool) -> ProposalStats:
        return self.hit if after_hit else self.miss

    def observe(self, after_hit: bool, accepted: int, drafted: int, bonus_rank: int | None = None,
                rank_limit: int | None = None) -> None:
        """Record one row's round. Bonus rank as in MissRateEstimator.update; both None = rank not observed."""
        s = self.stats(after_hit)
        s.alpha.update(accepted, drafted)
        if bonus_rank is not None or rank_limit is not None:
            s.miss.update(bonus_rank, rank_limit)

    def schedule(self, after_hit: bool) -> list[int]:
        i = 0 if after_hit else 1
        if self.fixed[i] is not None:
            return list(self.fixed[i])
        s = self.stats(after_hit)
        a = self.alpha[i] if self.alpha[i] is not None else s.alpha.value
        r, c = (self.r[i], 1.0) if self.r[i] is not None else s.miss.fit()
        # quantised so schedules (and the tree masks built from them) do not jitter round to round
        return geometric_fanout(self.budget, round(a, 3), round(r, 2), self.K, top1_miss=round(c, 2))
