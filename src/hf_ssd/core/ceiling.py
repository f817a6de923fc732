"""What SSD can gain over synchronous SD at best, from the speed model (hf_ssd.core.speed_model), each at its best K.

Units as in the speed model: times in target verifies, speeds in tokens per verify-time. `draft_cost` is one
draft forward over one target verify (the overhead workload on this project's CPU: 8 of 28 layers, ~0.29; a 0.5B
draft against a 1.5B target on a GPU with CUDA graphs, about the ratio of their weight bytes).

The bound is optimistic for SSD on purpose: a round's tree costs its K tree steps (the glue forward carried over from
the previous round, as `draft/static_saguaro.py` does after a hit), each priced as one draft forward whatever its
width, and the hand-over and lookup are free. A miss commits `e_miss` tokens (the bonus alone by default: an n-gram
backup rarely lands more) and its backup costs nothing. Under the speed model, a ratio over SD that SSD cannot
reach here it does not reach in the engine either.
"""
from __future__ import annotations

from hf_ssd.core.speed_model import expected_tokens_per_round, sd_speedup, ssd_speedup

MAX_K = 8  # the most drafts per round the controller considers (control/plan.py uses this one)


def best_sd(alpha: float, draft_cost: float, max_K: int = MAX_K) -> tuple[float, int]:
    """(speedup over one-verify-per-token decoding, K) of synchronous SD at its best K <= max_K."""
    return max((sd_speedup(expected_tokens_per_round(alpha, K), K * draft_cost), K) for K in range(1, max_K + 1))


def best_ssd(alpha: float, draft_cost: float, p_hit: float, max_K: int = MAX_K,
             e_miss: float = 1.0) -> tuple[float, int]:
    """(speedup, K) of SSD at its best K <= max_K with a cache that hits `p_hit` of rounds (see the module doc)."""
    return max((ssd_speedup(p_hit, expected_tokens_per_round(alpha, K), e_miss, K * draft_cost, 0.0), K)
               for K in range(1, max_K + 1))


def break_even_hit_rate(alpha: float, draft_cost: float, ratio: float = 1.0, max_K: int = MAX_K) -> float | None:
    """The lowest hit rate at which SSD reaches `ratio` x SD's best (bisection; SSD's speed rises with p_hit), or
    None where even a perfect cache does not."""
    goal = ratio * best_sd(alpha, draft_cost, max_K)[0]
    if best_ssd(alpha, draft_cost, 1.0, max_K)[0] < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if best_ssd(alpha, draft_cost, mid, max_K)[0] >= goal else (mid, hi)
    return hi


def ceiling_rows(alphas=(1.0, 0.9, 0.8, 0.7), draft_costs=(0.29, 0.1), hit_rates=(1.0, 0.9, 0.7, 0.5),
                 max_K: int = MAX_K) -> list[dict]:
    """One row per (draft_cost, α): SD's best, SSD's best at each hit rate, and the hit rates SSD needs for 1x and
    1.2x SD."""
    rows = []
    for c in draft_costs:
        for a in alphas:
            sd, sd_K = best_sd(a, c, max_K)
            ssd = {p: best_ssd(a, c, p, max_K) for p in hit_rates}
            rows.append({"draft_cost": c, "alpha": a, "sd": sd, "sd_K": sd_K,
                         "ssd_over_sd": {p: s / sd for p, (s, _) in ssd.items()},
                         "ssd_K": {p: K for p, (_, K) in ssd.items()},
                         "hit_rate_for_1x": break_even_hit_rate(a, c, 1.0, max_K),
                         "hit_rate_for_1.2x": break_even_hit_rate(a, c, 1.2, max_K)})
    return rows
