"""What a generation did: counters per request and per row, and a per-round timeline."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hf_ssd.core.fanout import RANK_FMAX


@dataclass
class RoundRecord:
    """One round: wall-clock marks (seconds since the request started) and what happened."""

    verify_start: float
    verify_end: float
    draft_start: float | None = None  # tree build (or JIT drafting in sync mode)
    draft_end: float | None = None
    resolve_start: float | None = None  # commit done (the engine's own host work ends), outcome handed over
    resolve_end: float | None = None  # next speculation ready (handshake + backup)
    rows: int = 0
    hits: int = 0
    lookups: int = 0
    backup: str | None = None
    handover_s: float | None = None  # resolve's time spent moving data to and from a worker (None: inline)


@dataclass
class SSDStats:
    mode: str = "ssd"
    worker: str = "inline"
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # row-rounds whose drafts were not all accepted (α = Σk / (Σk + rejected), whatever K was)
    emitted: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    cache_lookups: int = 0
    cache_hits: int = 0
    backup_rounds: Counter = field(default_factory=Counter)  # backup kind -> rounds it served
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per (row, round) -> count
    per_row_accepted: list[int] = field(default_factory=list)
    per_row_rounds: list[int] = field(default_factory=list)
    per_row_hits: list[int] = field(default_factory=list)
    per_row_lookups: list[int] = field(default_factory=list)
    fanout_after_hit: list[int] | None = None
    fanout_after_miss: list[int] | None = None
    budget: int | None = None
    alpha: float | None = None
    power_r: float | None = None
    # the rank of each target bonus token among the draft's guesses, for the rows the draft proposed (not a backup's):
    # [j] = how many had rank j, the last entry rank >= RANK_FMAX. What the controller learns the cache's hit rate from
    bonus_ranks: list[int] = field(default_factory=lambda: [0] * (RANK_FMAX + 1))
    backup_threshold: int | None = None
    fallback_reason: str | None = None  # set when the draft side failed and the exact sync path took over
    controller: dict | None = None  # the controller's choice, reasons, predictions and switches (mode="auto")
    controller_memory: Any = None  # what it learns (control.memory.Memory): plain steps, call lengths
    eager_call: bool = False  # a compiled setting's call that ran eagerly (session.eager_call): no compiled loop
    plain_probe: Any = None  # a call handed to plain decoding: measures α along its answer (control.plain_acceptance)
    draft_static: bool = False  # the Saguaro draft side ran on the static, fixed-shape cache (ssd_compile)
    # the target's few-row forwards through the packed linear kernel (kernels/packed_linear): "on: ..." or "off: why"
    packed_linear: str | None = None
    draft_compiled: bool = False  # ... and its glue and tree forwards ran as compiled graphs
    draft_compile_s: float = 0.0  # seconds this generation spent compiling them (0 when already compiled)
    # seconds of one compiled forward in the last tree, on a CPU (the rest of the tree's time is its fixed work);
    # None elsewhere (a CUDA graph's launch returns before it has run)
    draft_step_s: float | None = None
    # the same forwards by width, {tokens per row: (seconds, calls)}: a wide tree step costs more than a narrow one
    draft_forward_s: dict | None = None
    tree_reused: int = 0  # rounds whose tree carried the previous round's draft KV over instead of a glue forward
    # seconds of the target's prompt prefill in our loop (None: none, or shared with a draft prefilling alongside)
    target_prefill_s: float | None = None
    # the share of the padded batch's prompt tokens that our loop's grouped prefill runs (runtime.prefill), so the
    # controller prices that prefill per padded column whatever this call's padding was
    prefill_share: float = 1.0
    timeline: list[RoundRecord] = field(default_factory=list)
    wall_time: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def now(self) -> float:
        return time.perf_counter() - self.started

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per row-round (not counting the bonus token)."""
        n = sum(self.accept_hist.values())
        return sum(k * c for k, c in self.accept_hist.items()) / n if n else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        n = sum(self.accept_hist.values())
        return self.emitted / n if n else 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.cache_hits / self.cache_lookups if self.cache_lookups else None

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per round of verify, draft (tree/JIT), resolve (commit + handshake + backup), host (the
        engine's own work: commit, cache bookkeeping), and the whole round; with a thread or process worker also
        handover (the part of resolve spent moving data to and from the worker, not computing)."""
        recs = self.timeline
        if not recs:
            return {}

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        out = {"verify": mean([r.verify_end - r.verify_start for r in recs])}
        out["draft"] = mean([r.draft_end - r.draft_start for r in recs if r.draft_start is not None and r.draft_end])
        out["resolve"] = mean([r.resolve_end - r.verify_end for r in recs if r.resolve_end is not None])
        out["host"] = mean([r.resolve_start - r.verify_end for r in recs if r.resolve_start is not None])
        handover = [r.handover_s for r in recs if r.handover_s is not None]
        if handover:
            out["handover"] = mean(handover)
        starts = [r.verify_start for r in recs]
        out["round"] = mean([b - a for a, b in zip(starts, starts[1:])])
        return out

    def overlap_fraction(self) -> float | None:
        """Share of draft time that ran while the target was verifying (0 = serial, 1 = fully hidden)."""
        total = hidden = 0.0
        for r in self.timeline:
            if r.draft_start is None or r.draft_end is None:
                continue
            total += r.draft_end - r.draft_start
            hidden += max(0.0, min(r.draft_end, r.verify_end) - max(r.draft_start, r.verify_start))
        return hidden / total if total > 0 else None

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "worker": self.worker,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "emitted": self.emitted,
            "mean_accepted": round(self.mean_accepted, 4),
            "mean_tokens_per_round": round(self.mean_tokens_per_round, 4),
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "cache_lookups": self.cache_lookups,
            "cache_hits": self.cache_hits,
            "hit_rate": None if self.hit_rate is None else round(self.hit_rate, 4),
            "backup_rounds": dict(self.backup_rounds),
            "accept_hist": dict(sorted(self.accept_hist.items())),
            "per_row": {
                "accepted": self.per_row_accepted,
                "rounds": self.per_row_rounds,
                "hits": self.per_row_hits,
                "lookups": self.per_row_lookups,
            },
            "fanout_after_hit": self.fanout_after_hit,
            "fanout_after_miss": self.fanout_after_miss,
            "budget": self.budget,
            "alpha": self.alpha,
            "power_r": self.power_r,
            "backup_threshold": self.backup_threshold,
            "fallback_reason": self.fallback_reason,
            "controller": self.controller,
            "eager_call": self.eager_call,
            "packed_linear": self.packed_linear,
            "draft_static": self.draft_static,
            "draft_compiled": self.draft_compiled,
            "draft_compile_s": self.draft_compile_s,
            "tree_reused": self.tree_reused,
            "phase_means_s": {k: round(v, 6) for k, v in self.phase_means().items()},
            "overlap_fraction": self.overlap_fraction(),
            "target_prefill_s": None if self.target_prefill_s is None else round(self.target_prefill_s, 4),
            "wall_time_s": round(self.wall_time, 4),
        }
