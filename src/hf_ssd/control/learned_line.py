"""A part of a round's cost (an SSD tree, a synchronous draft, a verify) as a line in its size, learned from rounds.

The controller's cost lines are eager forwards timed once per process (control/costs.py). Compiled forwards
(ssd_compile, ssd_compile_target) cost something else, and not in proportion: on the overhead workload compiling
takes a draft step from ~3 ms to ~0.6 ms and a 5-token verify from ~6 ms to ~2.5 ms, and the eager lines of a
small model are noisy enough that two neighbouring widths differ by 2x. Scaled by one measured / modelled ratio,
the eager lines priced the siblings of the first compiled SSD plan that ran at 0.6x its measured speed (SSD K = 3
with 16 branches measured 6.6 ms a round, K = 3 with 12 branches was priced at 13 ms), and the plan that ran
first was kept: 0.63-0.69x the best SSD plan at α = 1.

So for compiled plans each part is priced off what the rounds measured. A compiled forward is launch-bound: its
cost depends little on its width, so a part is a line in its forwards (`tree_forwards`: glue and steps of an SSD
tree; a synchronous draft's steps) or a verify's tokens. What width does cost is counted as a share of a forward
per branch (BRANCH_SHARE): on the overhead workload the tree took 6.7 / 7.5 ms at K = 4 with 2 / 8 branches a step
and 10.3 / 11.8 ms at K = 8, about 0.03 ms per branch a step against ~0.9 ms a forward. Each size seen keeps its
own average (control.memory.Ema).

The slope is what a forward alone costs, where the drafter timed its compiled calls (on a CPU; a CUDA graph's
launch returns before it has run): the rest of a tree's time is its fixed work (the fork, the proposals, the
cache it builds), ~2-3 ms of a K = 2 tree's 6-8 ms on the overhead workload. Without it the line goes through the
sizes seen by least squares, where they are at least a forward apart, and from one size alone a tree or a draft
is priced in proportion to its forwards (which overrates longer trees: from SSD K = 2 it priced K = 8 no faster
at α = 1, where K = 8 ran 1.7x faster) and a verify as flat (a compiled verify of 9 tokens took 1.1x one of 5).
"""
from __future__ import annotations

from typing import Callable

from hf_ssd.control.decision import family
from hf_ssd.control.memory import Ema
from hf_ssd.control.plan import Plan

# a tree step's cost per branch beyond the first, in forwards (measured above; 0.1 / 0.8 in session 33's draft
# process: where the forwards are timed by width, control.tree_cost prices trees without it)
BRANCH_SHARE = 0.03
MIN_SPREAD = 1.0  # sizes (in forwards or tokens) a slope is fitted over: closer ones differ by noise


def tree_forwards(plan: Plan) -> float:
    """The size of `plan`'s draft work in forwards: an SSD tree's glue and K steps, each step counting
    BRANCH_SHARE more per branch beyond the first; a synchronous draft's K steps."""
    if plan.mode == "ssd":
        return plan.K + 1 + BRANCH_SHARE * plan.K * max(plan.budget - 1, 0)
    return float(plan.K)


class LearnedLine:
    """Seconds of one part of a round against its size x, from the rounds that ran.

    proportional: how a single size seen extrapolates: seconds in proportion to x (True: forwards, each about the
    same) or the same seconds at every x (False: a verify's width)."""

    def __init__(self, proportional: bool):
        self.proportional = proportional
        self.points: dict[float, Ema] = {}
        self.unit = Ema(outlier=None)  # seconds of one unit of x alone (a compiled forward), where measured

    def add(self, x: float, seconds: float, unit_s: float | None = None) -> None:
        """A part of size `x` took `seconds`, of which one unit of x (a forward) took `unit_s`, if known."""
        if x > 0 and seconds > 0:
            self.points.setdefault(round(float(x), 6), Ema()).add(seconds)
            if unit_s is not None and 0 < unit_s * x <= seconds * 1.5:
                self.unit.add(unit_s)

    def __bool__(self) -> bool:
        return any(e.value is not None for e in self.points.values())

    def __call__(self, x: float) -> float | None:
        """Seconds at size x; None before any round measured it."""
        seen = sorted((n, e.value) for n, e in self.points.items() if e.value is not None)
        if not seen:
            return None
        xs, ts = [n for n, _ in seen], [t for _, t in seen]
        mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
        unit = self.unit.value
        if unit is not None:  # the sizes seen, plus or less the forwards' own time
            fixed = sum(t - unit * n for n, t in seen) / len(seen)
            return max(fixed + unit * x, unit * x)
        if xs[-1] - xs[0] < MIN_SPREAD:  # sizes too close for a slope (a budget's few branches): one size
            return mt * x / mx if self.proportional else mt
        slope = sum((a - mx) * (b - mt) for a, b in zip(xs, ts)) / sum((a - mx) ** 2 for a in xs)
        slope = max(slope, 0.0)  # a longer tree or verify never costs less (a negative slope is noise)
        fixed = max(mt - slope * mx, 0.0)
        return fixed + slope * x


def measured_parts(plan: Plan, lines: dict, eager_parts: Callable[[], dict], draft_compiled: bool,
                   target_compiled: bool, verify_ratio: float | None) -> dict:
    """Seconds of `plan`'s round parts from the lines its compiled rounds measured (Memory.lines): its draft work
    (an SSD tree, a synchronous draft) and an SSD miss's JIT backup where the draft runs compiled, its verify where
    the target does. A family that has not run borrows: the draft lines of the other families (a forward is a
    forward, at its width: `_lenders`), the verifies' measured ratio to the eager line (`verify_ratio`), each only
    where cheaper than the eager price (`eager_parts()`, the eager model's parts; a family never looks worse than
    the model says before it has run), except for what the synchronous family measured, which ran alone: no
    other family's verify or draft step is faster, whatever the eager lines say. Those lines are timed at a short
    context; at batch 16 with 450-token prompts a compiled sync verify took 65 ms against an eager line of 15 ms
    (attention over the static cache's 1024 slots). Capped at the eager price, an SSD plan on a thread that had not
    run was predicted at 810 tok/s (32 ms a round) and ran at 168 (90-140 ms). Nothing before a round measured."""
    eager: dict = {}  # computed only where a family borrows (a decision prices ~230 plans)

    def eager_s(name: str) -> float:
        if not eager:
            eager.update(eager_parts())
        return eager["tree" if name == "draft" and plan.mode == "ssd" else name]

    parts = {}
    # an SSD tree whose forwards were timed by width is priced forward by forward (control.tree_cost)
    if draft_compiled and not (plan.mode == "ssd" and _tree_costs(plan, lines, parts, eager_s)):
        own = lines.get(("draft", family(plan), plan.int8))
        others = {key[1]: line for key, line in lines.items() if key[0] == "draft" and key[2] == plan.int8 and line}
        lenders, alone = _lenders(plan, others)
        sizes = {"draft": tree_forwards(plan)}
        if plan.mode == "ssd":
            sizes["backup"] = float(plan.K)  # K single-token steps
        for name, size in sizes.items():
            if own:
                parts[name] = own(size)
            elif lenders:
                wider = _width_factor(plan, eager_s) if alone and name == "draft" else 1.0
                borrowed = wider * min(line(size) for line in lenders)
                parts[name] = borrowed if alone else min(eager_s(name), borrowed)
    if target_compiled:
        own = lines.get(("verify", family(plan)))
        if own:
            parts["verify"] = own(plan.K + 1)
        elif verify_ratio is not None:
            parts["verify"] = eager_s("verify") * min(1.0, verify_ratio)
            alone = lines.get(("verify", "sync"))  # the target with every thread to itself: no verify is faster
            if alone:
                parts["verify"] = max(parts["verify"], alone(plan.K + 1))
    return parts


def _tree_costs(plan: Plan, lines: dict, parts: dict, eager_s: Callable[[str], float]) -> bool:
    """Price an SSD plan's tree and backup into `parts` from the trees whose forwards were timed by width
    (control.tree_cost.TreeCost): its own family's, else the cheapest other SSD family's, capped at the eager price
    (as the trees borrowed in measured_parts). False where no such tree has run."""
    own = lines.get(("tree", family(plan), plan.int8))
    if own:
        parts["draft"], parts["backup"] = own.tree(plan), own.backup(plan)
        return True
    if lines.get(("draft", family(plan), plan.int8)):  # its own trees ran, untimed by width: their line knows best
        return False
    others = [cost for key, cost in lines.items() if key[0] == "tree" and key[2] == plan.int8 and cost]
    if not others:
        return False
    parts["draft"] = min(eager_s("draft"), min(cost.tree(plan) for cost in others))
    parts["backup"] = min(eager_s("backup"), min(cost.backup(plan) for cost in others))
    return True


def _lenders(plan: Plan, others: dict[str, LearnedLine]) -> tuple[list[LearnedLine], bool]:
    """The measured draft lines (by family) a plan of a family that has not run borrows, and whether they are the
    synchronous draft's, which ran alone. An SSD tree borrows another worker's trees as they are (the same
    forwards), capped at the eager price: their time may hold their own contention. Else it borrows the
    synchronous steps, scaled to its width (`_width_factor`) and not capped: a step with the cores to itself is a
    floor for any family's, even above the eager lines, which miss what every compiled forward pays at a long
    context (attention over a static cache's slots; see measured_parts)."""
    trees = [line for fam, line in others.items() if fam.startswith("ssd")]
    if plan.mode == "ssd" and trees:
        return trees, False
    if plan.mode == "ssd" and "sync" in others:
        return [others["sync"]], True
    return list(others.values()), False


def _width_factor(plan: Plan, eager_s: Callable[[str], float]) -> float:
    """How much more an SSD tree's forward costs than a one-token step, in the eager lines (never below 1): its
    steps are budget x batch rows wide where a synchronous step is batch rows, which is launch-bound only where the
    eager lines say so."""
    step = eager_s("backup") / plan.K  # the backup is K one-token steps
    return max(1.0, eager_s("draft") / (tree_forwards(plan) * step))
