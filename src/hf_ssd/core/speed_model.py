"""Speed model (docs/algorithm.md §6): predicted speedups of AR, SD and SSD and the batch size b* at which to switch
backups.

Unless a name ends in `_s` (seconds), times are in units of one target verify forward and a speedup is tokens per
verify-time, i.e. the speedup over autoregressive decoding whose step costs one verify (AR = 1).
"""
from __future__ import annotations

from dataclasses import dataclass

AR_SPEEDUP = 1.0


def expected_tokens_per_round(alpha: float, K: int) -> float:
    """E[accepted + bonus] = Σ_{i=0..K} α^i = (1 - α^(K+1)) / (1 - α) under the capped geometric."""
    if not 0.0 <= alpha <= 1.0 or K < 0:
        raise ValueError(f"need alpha in [0, 1] and K >= 0, got {alpha}, {K}")
    if alpha == 1.0:
        return K + 1.0
    return (1.0 - alpha ** (K + 1)) / (1.0 - alpha)


def batch_hit_rate(p_hit: float, b: int) -> float:
    """P(every row of a batch of b hits the cache), rows independent."""
    return p_hit**b


def sd_speedup(e: float, t_draft: float) -> float:
    """Synchronous SD: E tokens per round of one verify plus `t_draft` (K draft steps) in verify units."""
    return e / (1.0 + t_draft)


def ssd_speedup(p_hit: float, e_hit: float, e_miss: float, t_tree: float, t_backup: float, *, batch: int = 1,
                t_sync: float = 0.0) -> float:
    """docs/algorithm.md §6: [p·E_hit + (1-p)·E_miss] / [max(1, T_tree) + (1-P_b)·T_backup] (+ T_sync per round).

    Tokens are per row: each row hits on its own with probability p. Time is per batched round: every round runs
    at max(verify, tree), since the miss is only known once both are done; if any row misses (1 - P_b, P_b = p^b),
    the whole batch then waits for the backup. At batch = 1 with T_tree <= 1 this is the paper's formula
    p·max(1, T_tree) + (1-p)·(1 + T_backup); with a tree slower than the verify, the paper's form would price a
    miss round as if the tree were hidden behind the verify.
    """
    if not 0.0 <= p_hit <= 1.0:
        raise ValueError(f"p_hit must be in [0, 1], got {p_hit}")
    P = batch_hit_rate(p_hit, batch)
    tokens = p_hit * e_hit + (1.0 - p_hit) * e_miss
    time = max(1.0, t_tree) + (1.0 - P) * t_backup + t_sync
    return tokens / time


def backup_threshold(p_hit: float, t_tree: float, t_jit: float, t_fast: float, e_hit: float, e_miss_jit: float,
                     e_miss_fast: float, max_batch: int = 1024) -> int:
    """b*: the smallest batch size at which the fast backup beats the JIT backup in `ssd_speedup(..., batch=b)`;
    max_batch + 1 if it never does up to max_batch.

    Model: per-row tokens N = p·E_hit + (1-p)·E_miss do not depend on b; round time
    T(b) = max(1, T_tree) + (1-P_b)·T_backup with P_b = p^b. A JIT backup proposes better (E_miss_jit >
    E_miss_fast) but stalls the batch longer (T_jit > T_fast). As b grows P_b falls, miss rounds dominate and the
    time ratio T_jit(b)/T_fast(b) rises monotonically from 1 to (M+T_jit)/(M+T_fast), M = max(1, T_tree), so there is at most one
    crossing. Use JIT for b < b*, fast for b >= b*.
    With T_tree <= 1 and T_fast ~ 0 the switch condition is (1-p^b)/(1-p) · N_fast · (T_jit-T_fast) > E_jit-E_fast:
    the JIT's stall costs the whole batch with probability 1-p^b, while its better proposals only help the (1-p)
    rows that missed. (1-p^b)/(1-p) = 1 + p + ... + p^(b-1) grows with p, so in this model b* does NOT grow with
    p_hit: it shrinks (and is max_batch+1 when misses are so common that JIT's quality always pays).
    """

    def fast_wins(b: int) -> bool:
        return (ssd_speedup(p_hit, e_hit, e_miss_fast, t_tree, t_fast, batch=b)
                > ssd_speedup(p_hit, e_hit, e_miss_jit, t_tree, t_jit, batch=b))

    # The condition depends on b only through P_b, linearly: (1-P_b)·D > R. So the b where the fast backup wins are
    # a prefix of 1.. (D < 0: then it wins at b = 1 or nowhere), a suffix (D > 0) or all or none: a bisection
    # between a losing b = 1 and a winning max_batch finds the first. A scan of every b cost ~1 ms a round (2,048
    # speedups) where the JIT always wins, on the draft's critical path.
    if fast_wins(1):
        return 1
    if not fast_wins(max_batch):
        return max_batch + 1
    lo, hi = 1, max_batch  # fast loses at lo, wins at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fast_wins(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class RoundTimings:
    """Measured wall times of one (batched) round, in seconds."""
    verify_s: float  # target forward over the K+1 tokens of a proposal
    tree_s: float  # draft: glue forward + K tree steps building the speculation cache
    draft_step_s: float  # one draft forward of one token per row (synchronous SD does K per round)
    backup_s: float  # backup drafting after a miss (JIT: ~K draft steps; n-gram / random: ~0)
    ar_step_s: float | None = None  # target forward over one token; defaults to verify_s
    sync_s: float = 0.0  # SSD handshake per round (send the outcome, look up the cache)


@dataclass(frozen=True)
class Prediction:
    """Predicted tokens/s (summed over the batch)."""
    ar_tps: float
    sd_tps: float
    ssd_tps: float

    @property
    def sd_speedup(self) -> float:
        return self.sd_tps / self.ar_tps

    @property
    def ssd_speedup(self) -> float:
        return self.ssd_tps / self.ar_tps

    @property
    def ssd_over_sd(self) -> float:
        return self.ssd_tps / self.sd_tps


def predict(t: RoundTimings, *, K: int, p_hit: float, alpha: float | None = None,
            alpha_backup: float | None = None, e_hit: float | None = None, e_miss: float | None = None,
            batch: int = 1) -> Prediction:
    """Predicted AR / SD / SSD tokens/s from measured times and hit/accept stats, to compare with measurements.

    Tokens per round come from `alpha` (primary draft; also used by SD) and `alpha_backup` (proposals after a
    miss; defaults to alpha) via `expected_tokens_per_round`, or directly from measured `e_hit` / `e_miss`.
    """
    if e_hit is None:
        if alpha is None:
            raise ValueError("give alpha or e_hit")
        e_hit = expected_tokens_per_round(alpha, K)
    if e_miss is None:
        e_miss = e_hit if alpha_backup is None else expected_tokens_per_round(alpha_backup, K)
    v = t.verify_s
    ar = batch / (t.ar_step_s if t.ar_step_s is not None else v)
    sd = batch * sd_speedup(e_hit, K * t.draft_step_s / v) / v
    ssd = batch * ssd_speedup(p_hit, e_hit, e_miss, t.tree_s / v, t.backup_s / v, batch=batch, t_sync=t.sync_s / v) / v
    return Prediction(ar, sd, ssd)
