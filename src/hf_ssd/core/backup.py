"""Which backup serves the rows that missed: the just-in-time neural draft or the fast n-gram lookup.

A batch round waits for its slowest row, so a JIT backup stalls everyone whenever any row misses (probability
1 - p_hit^b). Below the batch size b* the JIT's better proposals pay for that; from b* on the fast backup wins
(docs/algorithm.md §6). b* is recomputed from the run's own measurements.
"""
from __future__ import annotations

from hf_ssd.config import SSDConfig
from hf_ssd.core.ranks import from_rank0
from hf_ssd.core.speed_model import backup_threshold, expected_tokens_per_round


class Mean:
    """Running mean; a `prior` counts as `weight` observations (None: no value until the first observation)."""

    def __init__(self, prior: float | None = None, weight: float = 2.0):
        self.total, self.count = (prior * weight, weight) if prior is not None else (0.0, 0.0)
        self.last: float | None = None

    def add(self, x: float) -> None:
        self.total += x
        self.count += 1
        self.last = x

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


class BackupPolicy:
    def __init__(self, config: SSDConfig):
        K = self.K = config.num_draft_tokens
        self.forced = None if config.backup == "auto" else config.backup
        self.fixed_threshold = config.backup_batch_threshold
        self.p_hit = Mean(0.5)
        # Times come from this run alone: a prior in seconds would be off by orders of magnitude between a 2-core CPU
        # and a GPU, and a backup priced by its prior alone (never tried) would never be tried.
        self.t_verify, self.t_tree, self.t_jit, self.t_fast = Mean(), Mean(), Mean(), Mean()
        self.tokens = {"cache": Mean(expected_tokens_per_round(0.7, K)), "jit": Mean(expected_tokens_per_round(0.7, K)),
                       "ngram": Mean(1.2)}

    def threshold(self) -> int:
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        v = max(self.t_verify.value or 1.0, 1e-9)
        tree = self.t_tree.value if self.t_tree.value is not None else v
        # a JIT backup not run yet: K single-token draft steps, against the tree's K + 1 forwards (an optimistic
        # guess, so it gets tried and measured)
        jit = self.t_jit.value if self.t_jit.value is not None else tree * self.K / (self.K + 1)
        fast = self.t_fast.value or 0.0
        return backup_threshold(
            self.p_hit.value, tree / v, jit / v, fast / v,
            self.tokens["cache"].value, self.tokens["jit"].value, self.tokens["ngram"].value, max_batch=4096,
        )

    def choose(self, batch: int) -> str:
        if self.forced is not None:
            return self.forced
        # measured times differ between tensor-parallel ranks; what they draft must not
        return from_rank0("jit" if batch < self.threshold() else "ngram")
