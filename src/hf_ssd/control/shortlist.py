"""The plans a decision predicts between full evaluations.

A full evaluation predicts every candidate plan (about 250 on a CPU with an int8 draft and a kept draft process) and
cost ~12 ms on the project's CPU. A call made two (at its start, and the first mid-call one), so on the overhead
workload, whose calls take ~0.4 s, `ssd=True` ran the very plan of the hand-picked SSD row 4-16% slower than that row.
Most plans cannot win: they are far slower than the best, and a few rounds of measurement do not bring them back.
So a full evaluation keeps a shortlist, and the next decisions predict only that:
- the fastest SHORTLIST_TOP plans (the close competitors, their budgets and thread splits);
- the fastest plan of each (family, K) and of each (family, precision): where the call's α moves (a code answer
  after a chat one), the best K of each family moves with it, and a family's calibration moves all its plans alike.
A full evaluation comes back every SHORTLIST_EVERY decisions, whenever the candidate plans changed (other
options, a kept draft process that came up), and whenever α moved SHORTLIST_ALPHA_MOVE from where the shortlist was
made: the best budget of each K moves with α, and a shortlist made at the prior α = 0.7 kept SSD K = 8 with 12
branches, not with 2. Calls at α = 1 then never priced the plan that ran 1.18x compiled sync SD's speed (a call
makes few decisions: SHORTLIST_EVERY of them took ten calls).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hf_ssd.control.plan import Plan, Prediction

SHORTLIST_TOP = 8
SHORTLIST_EVERY = 16
SHORTLIST_ALPHA_MOVE = 0.1


@dataclass
class Shortlist:
    plans: frozenset[Plan]
    source: int  # candidates_key of the candidate plans it was made from: other candidates need a full evaluation
    alpha: float  # the full-precision draft's α it was made at
    decisions: int = 0  # decisions made on it since it was made

    def usable(self, source: int, alpha: float) -> bool:
        return (self.source == source and self.decisions < SHORTLIST_EVERY
                and abs(alpha - self.alpha) < SHORTLIST_ALPHA_MOVE)

    def restrict(self, candidates: list[Plan], keep: Plan | None) -> list[Plan]:
        """The candidates on the shortlist (and `keep`, the running plan), in the candidates' order."""
        self.decisions += 1
        return [p for p in candidates if p in self.plans or p == keep]


def candidates_key(candidates: list[Plan]) -> int:
    return hash(tuple(candidates))


def make_shortlist(ranked: list[Prediction], source: int, family: Callable[[Plan], str], alpha: float) -> Shortlist:
    """The shortlist of a full evaluation of the candidates `source` (candidates_key) at α `alpha`, from its
    predictions `ranked` fastest first."""
    keep = {pred.plan for pred in ranked[:SHORTLIST_TOP]}
    seen: set[tuple] = set()
    for pred in ranked:
        plan = pred.plan
        for group in ((family(plan), "K", plan.K), (family(plan), "int8", plan.int8)):
            if group not in seen:
                seen.add(group)
                keep.add(plan)
    return Shortlist(frozenset(keep), source, alpha)
