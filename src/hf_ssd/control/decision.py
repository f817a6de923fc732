"""What a decision is (the plan, why, and the alternatives it weighed) and the plan families decisions reason in."""
from __future__ import annotations

from dataclasses import dataclass

from hf_ssd.control.plan import Plan, Prediction

COMPLEXITY = {"plain": 0, "sync": 1, "ssd": 2}


@dataclass(frozen=True)
class Horizon:
    """What is left of a call: `tokens` per row still to generate (at most), and the `context` per row (committed
    tokens, left padding included) that a drafter starting now would prefill; at a call's start, `prefill_share`:
    the prompt tokens our loop's grouped prefill runs against transformers' padded one (runtime.prefill)."""

    tokens: int
    context: int
    prefill_share: float = 1.0


@dataclass
class Decision:
    plan: Plan
    reason: str
    table: list[Prediction]  # the best few alternatives, fastest first
    drafting: Prediction | None = None  # the fastest drafting plan (sync or SSD), whatever was chosen
    choice: Plan | None = None  # an exploration's: the plan it displaced (what the controller would run otherwise)
    in_loop: bool = False  # plain decoding run in our loop from the call's start, not handed off (control.plain_loop)

    @property
    def chosen(self) -> Plan:
        """The controller's own choice: the plan run, or for an exploration of a family, the plan it displaced."""
        return self.choice or self.plan


def family(plan: Plan) -> str:
    """Plans that share a calibration: a mode, and for SSD its worker (a process's hand-over, a thread's GIL)."""
    return f"ssd:{plan.worker}" if plan.mode == "ssd" else plan.mode


def retunable(running: Plan | None, other: Plan) -> bool:
    """Can the running plan become `other` by changing K alone, keeping its draft's cache (no restart, no prefill;
    draft.sync.SyncDrafter.retune)? Synchronous plans on the same draft and threads can."""
    return (running is not None and running.mode == other.mode == "sync" and running.int8 == other.int8
            and running.threads == other.threads)


def simpler(a: Plan, b: Plan) -> bool:
    """Is plan a simpler than plan b: an easier mode, or the same mode with a smaller speculation tree."""
    return (COMPLEXITY[a.mode], a.budget) < (COMPLEXITY[b.mode], b.budget)
