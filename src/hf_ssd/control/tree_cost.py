"""A compiled SSD tree's seconds as its forwards, each priced by its width, plus the work between them.

A tree runs a glue forward of K + 1 tokens per row, then K steps of `budget` tokens per row; a miss's JIT backup runs
K steps of one token. Compiled forwards are launch-bound but not free in their width: on the overhead workload's
draft process (1 thread, HumanEval prompts, session 33) a tree took 3.7 ms at K = 2 with 4 branches and 7.6 ms with
16, 9 ms at K = 8 with 2 and 13.8 ms with 9. Fitted, a forward costs ~0.7-0.9 ms and each branch of a step ~0.1 ms
more: a step of 16 branches costs about twice a step of 2. A size in forwards with a fixed share per branch
(learned_line.tree_forwards, 0.03 of a forward, measured in an earlier session on another machine) cannot carry
that from one plan to another: from SSD K = 2 with 16 branches it priced K = 8 with 2 branches at 17 ms a tree
(measured 8-10), and `ssd=True` never tried the plan that ran fastest.

So where the drafter timed each compiled forward (on a CPU: StaticKV.width_run), a family's trees learn two lines:
a forward's seconds against its width (tokens per row, from every forward timed), and the rest of a tree's time
(the fork, the proposals, the attention inputs between the forwards) against its number of forwards. Pricing a
plan that has not run then needs no share per branch: its glue and steps are read off the width line.
"""
from __future__ import annotations

from hf_ssd.control.learned_line import LearnedLine
from hf_ssd.control.plan import Plan

REST_FLOOR_S = 1e-6  # the rest of a tree is never negative (the forwards' timers and the tree's clock differ)
# Until the forwards timed span FIT_SPREAD tokens of width, a forward's width is priced by a prior: each token per row
# adds WIDTH_SHARE of a forward of no width. Measured on the overhead workload's draft process: ~0.7-0.9 ms a forward
# and ~0.05-0.1 ms per token of width (session 33: trees of K = 8 took 9 ms with 2 branches and 13.8 ms with 9).
# With only the widths of one plan seen (K = 8 with 9 branches: all its forwards 9 wide) the line was flat, every
# budget cost the same, and `ssd=True` ran 8 branches where 2 ran the round 1.3x faster.
WIDTH_SHARE = 0.1
FIT_SPREAD = 4.0


class TreeCost:
    """Seconds of one family's compiled trees (and JIT backups), from trees whose forwards were timed."""

    def __init__(self):
        self.forward = LearnedLine(proportional=False)  # seconds of one forward against its tokens per row
        self.rest = LearnedLine(proportional=True)  # seconds between the forwards against their number

    def add(self, seconds: float, forwards: dict) -> None:
        """A tree took `seconds`, of which its compiled forwards took `forwards` = {width: (seconds, calls)}."""
        calls = sum(c for _, c in forwards.values())
        if seconds <= 0 or calls <= 0:
            return
        for width, (s, c) in forwards.items():
            if c > 0 and s > 0:
                self.forward.add(width, s / c)
        self.rest.add(calls, max(seconds - sum(s for s, _ in forwards.values()), REST_FLOOR_S))

    def __bool__(self) -> bool:
        return bool(self.forward) and bool(self.rest)

    def forward_s(self, width: int) -> float:
        """One forward of `width` tokens per row: off the line through the widths timed where they span FIT_SPREAD
        tokens, else from their mean by the prior slope (WIDTH_SHARE)."""
        seen = [w for w, e in self.forward.points.items() if e.value is not None]
        if max(seen) - min(seen) >= FIT_SPREAD:
            return self.forward(width)
        mean = sum(seen) / len(seen)
        return self.forward(mean) * (1 + WIDTH_SHARE * width) / (1 + WIDTH_SHARE * mean)

    def tree(self, plan: Plan) -> float:
        """A whole tree of `plan`: its glue (K + 1 tokens per row) and K steps (budget tokens per row)."""
        return self.rest(plan.K + 1) + self.forward_s(plan.K + 1) + plan.K * self.forward_s(plan.budget)

    def backup(self, plan: Plan) -> float:
        """A miss's JIT backup of `plan`: K one-token steps."""
        return self.rest(plan.K) + plan.K * self.forward_s(1)
