"""Plans (one exact way to decode) and their predicted speed from measured costs and acceptance.

Every plan yields the target's exact output law; they differ only in speed. A plan's speed is tokens per round
over seconds per round (docs/algorithm.md §6), with the round's parts read off the measured cost lines:

- plain:  one target forward of 1 token per row;
- sync:   K draft steps, then a verify of K+1 tokens;
- ssd:    the verify and the tree (glue of K+1 tokens + K steps over N branches) at the same time, each on its
          share of the hardware; on a miss the batch also waits for the backup (K draft steps). A thread worker
          hides only the measured overlap (the GIL); a process worker hides all of it but pays a hand-over.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hf_ssd.control.costs import Costs
from hf_ssd.core.ceiling import MAX_K  # the most drafts per round the controller considers
from hf_ssd.core.fanout import expected_hit_rate, geometric_fanout
from hf_ssd.core.speed_model import expected_tokens_per_round

MODES = ("plain", "sync", "ssd")
# A process worker's hand-over per round (write the outcome to shared memory, wake the child, read its answer):
# about 0.6 ms measured at batch 1 on the project's CPU; the controller replaces it by measured rounds once it runs.
PROCESS_HANDOVER_S = 6e-4


@dataclass(frozen=True)
class Plan:
    mode: str  # "plain" (target steps only), "sync" (synchronous SD) or "ssd" (Saguaro)
    K: int = 0  # drafts per round
    budget: int = 0  # branches per row in the speculation cache (ssd)
    worker: str = "inline"  # where the ssd tree is built: "thread" (beside the verify) or "inline"
    int8: bool = False  # the int8 copy of the draft (CPU)
    threads: tuple[int, int] | None = None  # (target, draft) intra-op threads; None = as the caller set them

    @property
    def label(self) -> str:
        if self.mode == "plain":
            return "plain"
        parts = [self.mode, f"K={self.K}"]
        if self.mode == "ssd":
            parts += [f"budget={self.budget}", self.worker]
        if self.int8:
            parts.append("int8")
        if self.threads is not None:
            parts.append(f"threads={self.threads[0]}+{self.threads[1]}")
        return " ".join(parts)

    def options(self) -> dict:
        """The SSDConfig fields this plan stands for."""
        opts = {"mode": "sync" if self.mode == "plain" else self.mode, "num_draft_tokens": max(self.K, 1),
                "draft_quantize": "int8" if self.int8 else None}
        if self.mode == "ssd":
            opts.update(budget=self.budget, worker=self.worker)
        if self.threads is not None:
            opts.update(target_threads=self.threads[0], draft_threads=self.threads[1])
        return opts


@dataclass(frozen=True)
class Acceptance:
    """What the draft's proposals are worth: per-token acceptance and how guessable the bonus token is."""

    alpha: float = 0.7  # per-token acceptance of the primary draft
    alpha_backup: float | None = None  # of the backup's proposals after a miss (default: alpha, a JIT backup)
    r: float = 1.0  # miss-rate exponent: P(bonus outside the top F) = top1_miss * F^-r
    top1_miss: float = 0.5


@dataclass(frozen=True)
class Served:
    """What SSD's rounds measured of the speculation cache, beyond the acceptance model: how often it missed, and
    what the rows it served and the rows a backup served after a miss committed, each over the model's figure.

    The model prices every row at the primary draft's tokens per round and the hit rate at the fitted guessability.
    On the overhead workload at α ≈ 0.7 (K = 2, batch 1) budget 3 hit 58% of rounds and committed 1.7-1.9 tokens a
    round, budgets 12-16 hit 93% and committed 2.0-2.4: a row a backup served committed far less. Pooled over the
    SSD plans as one yield, that shortfall was spread over every budget alike, and `ssd=True` ran budget 3."""

    miss_ratio: float = 1.0  # measured misses / modelled misses
    hit_yield: float = 1.0  # committed / modelled tokens of the rows served from the cache
    miss_yield: float = 1.0  # ... of the rows a backup served


def modelled_hit_rate(plan: Plan, acc: Acceptance) -> float:
    """The acceptance model's probability that an SSD round's outcome is in `plan`'s speculation cache."""
    # α to 3 decimals: the fan-out is cached per α (core.fanout), and the measured α moves every round
    fanout = geometric_fanout(plan.budget, round(acc.alpha, 3), acc.r, plan.K, top1_miss=acc.top1_miss)
    return expected_hit_rate(fanout, acc.alpha, acc.r, top1_miss=acc.top1_miss)


@dataclass
class Prediction:
    plan: Plan
    tokens_per_round: float  # summed over the batch
    round_s: float
    p_hit: float | None = None
    parts: dict = field(default_factory=dict)  # seconds of each part of the round, for reasons and `doctor`
    startup_s: float = 0.0  # seconds before its first round in this call: the draft's prefill (a switch redoes it)
    horizon: float = 0.0  # tokens (over the batch) the call has left to generate; 0: not known

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_round / self.round_s if self.round_s > 0 else 0.0

    @property
    def call_tokens_per_s(self) -> float:
        """Tokens per second over what is left of the call, its start-up included: a draft prefill is paid once per
        call, so it matters for short generations from long prompts and large batches, and not otherwise."""
        speed = self.tokens_per_s
        if self.horizon <= 0 or self.startup_s <= 0 or speed <= 0:
            return speed
        return self.horizon / (self.horizon / speed + self.startup_s)


def verify_s(plan: Plan, costs: Costs) -> float:
    """Modelled seconds of the plan's verify (K+1 tokens per row): beside the tree, on the target's share of the
    cores, for a concurrent SSD worker; on every thread otherwise."""
    split = plan.mode == "ssd" and plan.worker != "inline" and costs.split is not None
    return costs.target(split)(plan.K + 1)


def predict(plan: Plan, costs: Costs, acc: Acceptance, batch: int, measured: dict | None = None,
            served: Served | None = None) -> Prediction:
    """Predicted tokens per round and seconds per round of `plan`. The engine's own work per round is not modelled:
    the controller calibrates it away with measured round times. measured: seconds of the round's parts that the
    controller priced from compiled rounds instead of the eager cost lines ("verify"; "draft": a synchronous
    draft or an SSD tree; "backup"), each optional. served: an SSD cache's measured misses and yields."""
    if plan.mode == "plain":
        t = costs.plain_step()
        return Prediction(plan, float(batch), t, parts={"target_step": t})
    measured = measured or {}
    K = plan.K
    e = expected_tokens_per_round(min(max(acc.alpha, 0.0), 1.0), K)
    verify = measured.get("verify") or verify_s(plan, costs)
    if plan.mode == "sync":
        draft = costs.draft(False, plan.int8)
        drafting = measured.get("draft") or draft(2) + (K - 1) * draft(1)
        return Prediction(plan, batch * e, verify + drafting, parts={"verify": verify, "draft": drafting})
    concurrent = plan.worker != "inline"
    split = concurrent and costs.split is not None
    draft = costs.draft(split, plan.int8)
    tree = measured.get("draft") or draft(K + 1) + K * draft(plan.budget)
    backup = measured.get("backup") or draft(1) + (K - 1) * draft(1)
    served = served or Served()
    p_hit = 1.0 - min(1.0, (1.0 - modelled_hit_rate(plan, acc)) * served.miss_ratio)
    e_miss = e if acc.alpha_backup is None else expected_tokens_per_round(acc.alpha_backup, K)
    all_hit = p_hit**batch
    # beside the verify, the tree hides as far as the two really overlap (a thread shares the GIL; measured)
    overlap = costs.overlap if plan.worker == "thread" else 1.0
    base = max(verify, tree) + (1.0 - overlap) * min(verify, tree) if concurrent else verify + tree
    round_s = base + (1.0 - all_hit) * backup + (PROCESS_HANDOVER_S if plan.worker == "process" else 0.0)
    tokens = batch * (p_hit * e * served.hit_yield + (1.0 - p_hit) * e_miss * served.miss_yield)
    return Prediction(plan, tokens, round_s, p_hit, parts={"verify": verify, "tree": tree, "backup": backup})


def candidates(costs: Costs, max_K: int = MAX_K, budgets: tuple[int, ...] = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64),
               modes: tuple[str, ...] = MODES, workers: tuple[str, ...] = ("thread",)) -> list[Plan]:
    """Every plan worth predicting on this hardware. Inline SSD is left out: it builds the tree and then verifies,
    so it never beats synchronous SD. A process worker is a candidate only where one is up (`workers`), and only
    in full precision: a kept process holds the draft as it was given."""
    int8s = (False, True) if costs.draft_int8_all is not None else (False,)
    plans = [Plan("plain")] if "plain" in modes else []
    for K in range(1, max_K + 1):
        for int8 in int8s:
            if "sync" in modes:
                plans.append(Plan("sync", K, int8=int8))
            if "ssd" not in modes:
                continue
            for worker in workers:
                if worker == "process" and int8:
                    continue
                # the narrowest tree that covers the K + 1 outcomes is always one, and narrower ones too: at α = 1
                # only k = K occurs, and 2 branches beat K + 1 at K = 8 (1.4x a round, docs/controller.md); the hit
                # rate model prices what they leave out, and their forwards are priced width by width (tree_cost)
                wide = sorted({*budgets, K + 1}) if len(budgets) > 1 else budgets
                plans += [Plan("ssd", K, budget, worker, int8, costs.split) for budget in wide]
    return plans
