"""How measurements correct the cost model's prices: a plan that ran is priced by its own round times (aged as
other plans run, since a machine's speed drifts); one that has not is priced by the model, calibrated by its
family's measured plans (or, before its family ran, by the others' where that makes it cheaper). The controller
(control/controller.py) asks these functions for every prediction; they read its memory and its model."""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from hf_ssd.control.decision import family
from hf_ssd.control.memory import PLAIN_IN_LOOP_TAIL, PLAIN_TAIL_FORESEEN, Memory
from hf_ssd.control.learned_line import tree_forwards
from hf_ssd.control.plan import Plan, predict

if TYPE_CHECKING:
    from hf_ssd.control.controller import Controller

MIN_ROUNDS = 4  # rounds a plan must have run before its measured round time replaces the model's
# A plan's measurement ages as other plans run: after this many rounds (all plans together) it counts half, and
# the prediction leans toward what the cost model and the fresh measurements say. A machine's speed drifts; a plan
# measured in a slow spell would otherwise never be chosen, so never measured again.
STALE_HALF_LIFE = 1024
MAX_DRIFT = 0.75  # ... but never below this fraction of the measured round: drift is tens of percent, not more


def calibration(ctl: Controller, mode: str, max_age: int | None = None) -> float:
    """Measured / modelled round time of the plans of `mode` (a plan `family`) that ran: the engine's own work,
    thread contention and whatever else the cost lines miss. Without it, plans that never ran would look better
    than their siblings that did, and the controller would hop between them.

    A family that has not run takes the other families' ratio only where it is below 1: the cost lines are
    eager forwards, and compiled forwards (ssd_compile) are faster for every family alike, while a slowdown
    (contention on one side's cores) may be the measured family's own. So each family is tried at most once
    before its own measurements take over, and never looks worse than the model says before it has run.
    Plain decoding is the exception: unless the target is compiled, it runs transformers' own eager loop, as the
    model prices it; with a compiled target, a plain step is one target forward, so it takes the ratio measured
    on the verifies of the plans that ran (a whole round's ratio mixes in the draft's work and the hand-over,
    and underrated a compiled plain step by a third). max_age: only measurements at most this many rounds
    old count."""
    return ctl._shared(("calibration", mode, max_age), lambda: _ratio(ctl, mode, max_age))


def calibrated(ctl: Controller, plan: Plan, modelled: float, max_age: int | None = None) -> float:
    """`plan`'s modelled round time, calibrated by its family's measured plans: for a compiled plan whose
    parts are priced off its family's own rounds (compiled_parts), by the seconds those rounds took beyond
    their parts (the engine's own work and the hand-over, about the same whatever the plan's size), else by
    the ratio measured / modelled (calibration). As a ratio, the 3 ms a compiled K = 2 round spent beyond its
    tree and verify priced a K = 8 round 1.4x as much again, and `ssd=True` kept K = 2 where K = 8 ran 1.7-1.8x
    faster (benchmarks/overhead-a1-unit-session25)."""
    fam = family(plan)
    if ctl.draft_compiled and plan.mode != "plain" and ctl.memory.lines.get(("draft", fam, plan.int8)):
        extra = ctl._shared(("extra", fam, max_age), lambda: _extra(ctl, fam, max_age))
        if extra is not None:
            return max(modelled + extra, 0.5 * modelled)
    return (modelled + _slow_parts_s(ctl, plan, max_age)) * calibration(ctl, fam, max_age)


def _slow_parts_s(ctl: Controller, plan: Plan, max_age: int | None) -> float:
    """Seconds an eager SSD plan of a family that has not run adds to its modelled round where synchronous SD's
    rounds measured their verify or their draft's forwards (at the plan's precision) slower than the cost lines.
    Those lines are timed over a short context; over long prompts the target's verify and the draft's forwards are
    the same forwards in every family, so their slow-down is not sync's own. Only sync's: its parts run alone,
    while an SSD verify beside a tree is slowed by the tree too, which is that family's own contention (priced
    into sync, it kept `ssd=True` on SSD for a whole batch-1 run at 0.77x our SD). On the default pair at batch 4
    with ~300-token prompts the verifies ran 1.3-1.5x the line; an SSD plan on a thread, priced at the lines, was
    predicted 20-22 tok/s, ran 0.40-0.46 s rounds (15-16 tok/s) and took calls from synchronous SD (sync K = 1
    int8 ran 0.27-0.33 s rounds). Compiled plans price their parts off what compiled rounds measured
    (control.learned_line)."""
    if plan.mode != "ssd" or ctl.draft_compiled or ctl.plain_compiled or _has_run(ctl, family(plan), max_age):
        return 0.0
    verify, draft = ctl._shared(("sync slow-downs", plan.int8, max_age), lambda: _sync_ratios(ctl, plan.int8, max_age))
    model = ctl.model(plan)
    slow = {}
    if verify is not None and verify > 1.0:
        slow["verify"] = verify * model.parts["verify"]
    if draft is not None and draft > 1.0:
        slow.update(draft=draft * model.parts["tree"], backup=draft * model.parts["backup"])
    if not slow:
        return 0.0
    key = ("slow parts", plan, tuple(sorted(slow.items())))
    repriced = ctl._shared(key, lambda: predict(plan, ctl.costs, ctl.acceptance(plan.int8), ctl.batch, slow,
                                                ctl.served(plan)).round_s)
    return repriced - model.round_s


def _sync_ratios(ctl: Controller, int8: bool, max_age: int | None) -> tuple[float | None, float | None]:
    """Median measured / modelled seconds of the verify (any precision) and of the draft work (at precision
    `int8`) of the synchronous plans that ran; None where none measured it."""
    verifies, drafts = [], []
    verify_line = ctl.memory.lines.get(("verify", "sync"))
    draft_line = ctl.memory.lines.get(("draft", "sync", int8))
    for plan, _ in _measured_rounds(ctl.memory, max_age):
        if plan.mode != "sync":
            continue
        parts = ctl.model(plan).parts
        if verify_line:
            verifies.append(verify_line(plan.K + 1) / max(parts["verify"], 1e-9))
        if draft_line and plan.int8 == int8:
            drafts.append(draft_line(tree_forwards(plan)) / max(parts["draft"], 1e-9))
    return (statistics.median(verifies) if verifies else None, statistics.median(drafts) if drafts else None)


def _has_run(ctl: Controller, fam: str, max_age: int | None) -> bool:
    return any(family(plan) == fam for plan, _ in _measured_rounds(ctl.memory, max_age))


def _measured_rounds(memory: Memory, max_age: int | None) -> list[tuple[Plan, float]]:
    """(plan, measured seconds a round) of the plans that ran MIN_ROUNDS rounds, measured at most `max_age`
    rounds ago (None: any age)."""
    return [(plan, measured.value) for plan, measured in memory.round_s.items()
            if measured.n >= MIN_ROUNDS and (max_age is None or memory.age(plan) <= max_age)]


def _extra(ctl: Controller, fam: str, max_age: int | None) -> float | None:
    """Median seconds the measured plans of family `fam` took per round beyond their modelled round; None
    where none has run."""
    extra = [seconds - ctl.model(plan).round_s for plan, seconds in _measured_rounds(ctl.memory, max_age)
             if family(plan) == fam]
    return statistics.median(extra) if extra else None


def _ratio(ctl: Controller, mode: str, max_age: int | None) -> float:
    ratios = {plan: seconds / max(ctl.model(plan).round_s, 1e-9)
              for plan, seconds in _measured_rounds(ctl.memory, max_age)}
    own = [r for plan, r in ratios.items() if family(plan) == mode]
    if own:
        return statistics.median(own)
    if mode == "plain" and not ctl.plain_compiled:
        return 1.0
    if mode == "plain" and ctl.memory.verify.n >= MIN_ROUNDS:
        drifted = _plain_drifted(ctl)
        return drifted if drifted is not None else min(1.0, ctl.memory.verify.value)
    if not ratios:
        return 1.0
    return min(1.0, statistics.median(ratios.values()))


def _plain_drifted(ctl: Controller) -> float | None:
    """A compiled plain step's measured / modelled ratio, measured a while ago, moved as the verifies' ratio has
    moved since (the machine's drift); None where plain has no such measurement. The verifies' ratio itself
    prices a plain step not yet measured, but transformers' compiled loop is not our verify forward (it ran
    0.75x-1.15x what that ratio said on the overhead workload), so an aged plain price leaning toward it
    re-checked plain for a difference that was never drift."""
    measured, then = ctl.memory.round_s.get(Plan("plain")), ctl.memory.plain_verify
    if measured is None or measured.n < MIN_ROUNDS or not then:
        return None
    return measured.value / max(ctl.model(Plan("plain")).round_s, 1e-9) * ctl.memory.verify.value / then


def tail_share(memory: Memory, plan: Plan, in_loop: bool = False) -> float:
    """The share of a plan's time that does its full batch's work (Memory.tail): its family's, once its family has
    run a batch's tail. A drafting family that has not (it never ran, or every call switched away from it before
    its rows began to end) takes the highest share among the drafting families that have: the tail is the
    answers' lengths (rows end at different rounds) on this hardware at this batch size, the same for every plan
    that drops the rows that ended; 1 where none has (it never looks worse than its measured siblings before it has
    run). Priced at 1 while synchronous SD's rounds were charged 0.75 for their tail, SSD plans that had not run a
    tail looked a third faster than sync at batch 4 (the default pair, paper setting, T = 0.7) and took three of six
    calls, at 0.76-0.89x our SD.

    Plain handed off to transformers' loop is the exception: its tail is the answers' (rows that end early stay on
    padding, so every row costs a step to the end), measured there, and before it has run there foreseen by our
    loop's calls (memory.foresee_plain_tail). Plain steps in our loop (`in_loop`) drop the rows that end, as every
    plan there does: they are priced like a drafting family (Memory.tail[PLAIN_IN_LOOP_TAIL] once they ran a
    tail)."""
    if plan.mode == "plain" and not in_loop:
        tail = memory.tail.get(family(plan)) or memory.tail.get(PLAIN_TAIL_FORESEEN)
        return 1.0 if tail is None else tail.share
    tail = memory.tail.get(PLAIN_IN_LOOP_TAIL if plan.mode == "plain" else family(plan))
    if tail is not None and tail.seen:
        return tail.share
    seen = [t.share for fam, t in memory.tail.items() if fam.startswith(("sync", "ssd:")) and t.seen]
    return max(seen, default=1.0)


def aged_round(ctl: Controller, plan: Plan, measured: float, modelled: float) -> float:
    """A measured round time, leaning toward the model (calibrated by fresh measurements only) as it ages, and
    only where that is faster, by at most the machine's drift (MAX_DRIFT): an old measurement may be of a slow
    spell, so a plan measured a little slower than the best gets re-checked once the doubt is worth a call; a
    plan that really is slow measures slow again and is left alone for a while, and one far slower than the
    best never comes back on the cost model's word (the model can be optimistic by more than any drift)."""
    age = ctl.memory.age(plan)
    if age <= 0:
        return measured
    fresh = 0.5 ** (age / STALE_HALF_LIFE)
    now = calibrated(ctl, plan, modelled, max_age=STALE_HALF_LIFE // 2)
    return fresh * measured + (1 - fresh) * min(measured, max(now, MAX_DRIFT * measured))
