"""The controller's rules for running a plan to learn, not only because it is predicted fastest: the cost model
and the acceptance it prices with are only as good as what has run, and a plan that never runs is never measured.

At a call's start: plain decoding measures no α, so while α rests on few rounds a call that would start plain
drafts instead (`alpha_exploration`); an untried plan of a family that has run needs a clear predicted gain over
its measured siblings (`untried_score`); a drafting family that has never run gets one call if it is predicted
close to the choice (`family_exploration`); while compiling is free, a family that has run gets one call of its
fastest plan where that has a K the family has not run and is predicted close to the choice (`untried_look`); the
untried K next to the measured choice's gets one call where it is predicted close to it (`neighbour_look`); and a
plan that one call measured, cold (compiled, or on a fresh draft process), gets a second (`second_look`).
A call that runs plain may have its draft read α off the answer afterwards (`plain_measurement`). Every plan is
exact: exploring costs speed, never the output law.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from hf_ssd.control.compiled import compiling_free
from hf_ssd.control.decision import Decision, Horizon, family
from hf_ssd.control.plain_acceptance import CHUNK
from hf_ssd.control.plan import Plan, Prediction

if TYPE_CHECKING:
    from hf_ssd.control.controller import Controller

# Plain decoding observes no acceptance: chosen on the prior α (or on a few unlucky rounds), it would be chosen
# forever. Until α rests on this many drafting rounds (a batch's rows each count as one), a call that would start
# plain runs the best drafting plan instead, if that is predicted within EXPLORE_WITHIN of plain; its rounds measure
# α, and a mid-call decision switches to plain where its rounds rule drafting out (controller.SWITCH_OPTIMISM).
EXPLORE_ROUNDS = 32
EXPLORE_WITHIN = 0.80
# A call that runs plain while drafting is predicted within MEASURE_WITHIN of it has its draft measure α along the
# answer afterwards (control.plain_acceptance), if that costs at most MEASURE_SHARE of the decoding of the calls it
# serves (itself and the MEASURE_EVERY - 1 after it): the next calls then decide on an α that plain calls keep up to
# date.
MEASURE_WITHIN = 0.70
MEASURE_SHARE = 0.05
# ... and at most once every MEASURE_EVERY calls: α moves with the prompts, not from call to call, and a pass after
# every plain call (five launch-bound draft forwards, priced as one) took 11-16 ms of the overhead workload's
# 0.4 s plain calls, where `ssd=True` running plain has nothing else to lose against plain generate()
MEASURE_EVERY = 4
# A plan's prediction before it ran is its family's calibrated model, and the model is off by tens of percent for
# some shapes (a K=2 tree on a process, predicted 1% above the measured sync SD, ran at 0.63x of it). At the start
# of a call an untried plan of a family that has run must be predicted UNTRIED_GAIN over the measured plans to be
# chosen: it is measured once it runs, but that call pays for the model's error.
UNTRIED_GAIN = 1.05
# A drafting family (sync, SSD on a thread, SSD on a process) that has never run is priced by the model and the
# other families' calibration, which misses what is its own: a compiled sync draft's single-row steps are faster
# than the eager cost lines by more than an SSD tree is. Once the chosen plan's family has run, a drafting family
# predicted within FAMILY_EXPLORE_WITHIN of it runs one call (its rounds then price it): unexplored, compiled sync
# SD was priced at 182 tok/s, never ran, and ran at 215 where the chosen SSD plan ran at 173.
FAMILY_EXPLORE_WITHIN = 0.85
# An untried plan of a family that has run is priced by extrapolating its siblings' measured rounds, and that is
# least sure for a K far from theirs: on the overhead workload at α = 1 the SSD trees measured at K = 2 (4 branches
# on a draft process) priced SSD K = 8 with 2 branches at ~590 tok/s, below compiled sync K = 8 (~615, measured); it
# ran at 778 against sync's 659 in the hand-picked rows, and `ssd=True` ran sync K = 8 in 35 of 36 calls. While the
# setting still compiles for free (control.compiled.compiling_free), the fastest untried plan of each family that has
# run gets one call if it is predicted within UNTRIED_LOOK_WITHIN of the choice: its compiles are the warm-up's then,
# and later they are charged to the call that switches, which a gain of tens of percent over a few calls never repays.
# Only with compiled forwards: eager plans are priced off cost lines timed width by width, not extrapolated (but the
# K next to the choice's gets a look of its own, below).
UNTRIED_LOOK_WITHIN = 0.80
# Eager plans are priced off cost lines timed once per process, one forward per width over a short context, and
# the next K's price is the running K's measured round plus the lines' step: that step can be off by 2x. On an
# Intel 2-core machine the default pair's lines put 36 ms on each verify token and 63 ms on each int8 draft step
# where the engine's rounds over ~300-token prompts took 17 and 47 ms; sync K = 4 was priced 1-3% below the measured
# K = 3, never ran (an untried plan needs UNTRIED_GAIN at a call's start), and ran 1.06x K = 3 in the hand-picked
# rows (`ssd=True` 0.92x our SD K = 4 at batch 1, T = 0: benchmarks/default-pair-b1-equal-session46). So the untried
# K next to the measured best's (its family, precision, budget and threads), predicted within NEIGHBOUR_LOOK_WITHIN
# of it, gets one call; from a neighbour that measures faster the climb goes on, one K per call.
NEIGHBOUR_LOOK_WITHIN = 0.93

# A plan's first call is its coldest: its compiled graphs run for the first time, a fresh draft process touches its
# weights, and the machine's drift is not averaged out. A plan that only one call has measured, priced within
# SECOND_LOOK_WITHIN of the choice, runs one more call (once), which then sets its price: measured in its first
# call on a fresh draft process, SSD K=2 on the overhead workload at α ≈ 0.7 was priced at 15.2 ms a round against
# 11.3 ms in later calls, and the controller ran compiled plain decoding, 0.85x of it, for the rest of the bench.
# A cold call ran 0.72-0.78x the plan's later speed in both cases seen (the one above; SSD K=2 at 300 tok/s in one
# call against 390-420 for the hand-picked SSD rows of the same run, which left `ssd=True` on compiled plain
# decoding in 17 of 18 calls), so the window reaches that far.
SECOND_LOOK_WITHIN = 0.70
# Only a plan whose first call can run cold gets that look: one on a draft process, or with compiled forwards. An
# eager plan in this process runs warm from its first call (the models, their packed weights and the int8 draft are
# ready before any call), and its looks cost a call for no news: on the default pair at batch 4 (equal setting,
# two runs of session 43) the second looks at SSD K=1 on a thread ran 0.75x our SD in all four cases, after first
# calls at 0.83-0.96x; at batch 1 on ShareGPT an SSD thread plan 0.87x then 0.88x, sync K=2 0.98x then 0.93x.
# Stale looks (below) are for every plan: drift has nothing to do with a first call.
# ... and the call keeps it for this many rounds before a mid-call decision may leave it (its first call's price
# would otherwise send it back at the first decision)
SECOND_LOOK_ROUNDS = 16
# A machine's speed drifts by tens of percent over minutes (the same compiled loop ran 0.77-1.21x its median call
# to call here), and a plan that is not chosen is not measured: its price is of the moment it last ran, while the
# running plan's follows the machine. A plan priced within SECOND_LOOK_WITHIN of the choice whose last measurement
# is this many rounds old (all plans together) gets another look too, once per that many rounds: on the overhead
# workload at α ≈ 0.7 compiled sync SD, priced at 11.6 ms a round from the warm-up, was never run again in 18
# calls, while the hand-picked sync row ran 7.3 ms rounds and `ssd=True` ran an SSD plan at 0.82x of it.
# The stale looks share that cadence: one per STALE_LOOK_ROUNDS rounds, whichever plan is due. Each plan on its own
# clock, four plans within reach at batch 4 (α ≈ 0.7, T = 0.7) took 4 of 12 timed calls, at 0.55-0.9x the choice.
STALE_LOOK_ROUNDS = 256


def untried_score(ctl: Controller, pred: Prediction, ran: set[str]) -> float:
    """The speed a call-start decision ranks `pred` by: its prediction, over UNTRIED_GAIN where the plan has not
    run but its family has (`ran`; its siblings' measurements are the better evidence)."""
    if family(pred.plan) not in ran or ctl.measured(pred.plan):
        return pred.call_tokens_per_s
    return pred.call_tokens_per_s / UNTRIED_GAIN


def family_exploration(ctl: Controller, preds: list[Prediction], best: Prediction, ran: set[str]) -> Decision | None:
    """The best plan of a drafting family that has never run (`ran`) nor been explored, where it is predicted
    within FAMILY_EXPLORE_WITHIN of `best` and best's own family has run (the first call runs the best
    prediction; the next ones try the families it left out, one call each, once)."""
    if family(best.plan) not in ran:
        return None
    for pred in preds:  # fastest first
        fam = family(pred.plan)
        if fam in ran or fam in ctl.memory.explored:
            continue
        if pred.plan.mode == "plain" and not ctl.plain_compiled:  # priced by its own eager cost line
            continue
        # An exploration never compiles: a measurement is not worth a stall of seconds, however well the
        # compile is spread over the setting's future (one explored compiled sync SD call took 14.7 s)
        if pred.parts.get("compile", 0.0) > 0:
            continue
        if pred.call_tokens_per_s < FAMILY_EXPLORE_WITHIN * best.call_tokens_per_s:
            return None
        ctl.memory.explored.add(fam)
        return _explore(ctl, pred, best, preds, f"exploring {pred.plan.label}: {fam} has not run here, and its "
                        f"prediction ({pred.call_tokens_per_s:.2f} tok/s, from the cost model) is within "
                        f"{1 - FAMILY_EXPLORE_WITHIN:.0%} of the choice")
    return None


def untried_look(ctl: Controller, preds: list[Prediction], best: Prediction, ran: set[str]) -> Decision | None:
    """A drafting family's fastest plan, where that has a K the family (`ran`: one that has run) has not run (its
    budgets at a measured K are priced off their own forwards' widths, not extrapolated) and the family has had no
    such look yet, and it is predicted within UNTRIED_LOOK_WITHIN of `best` (itself measured), while compiling is
    free and something runs compiled; once per family."""
    if not (ctl.draft_compiled or ctl.plain_compiled) or not compiling_free(ctl.memory) or not ctl.measured(best.plan):
        return None
    measured_K = {(family(p), p.K) for p in ctl.memory.round_s if ctl.measured(p)}
    tops: dict[str, Prediction] = {}  # each family's fastest plan
    for pred in preds:
        top = tops.setdefault(family(pred.plan), pred)
        if pred.call_tokens_per_s > top.call_tokens_per_s:
            tops[family(pred.plan)] = pred
    looks = [pred for fam, pred in tops.items()
             if pred.plan.mode != "plain" and fam in ran and fam not in ctl.memory.untried_looks
             and (fam, pred.plan.K) not in measured_K
             and pred.call_tokens_per_s >= UNTRIED_LOOK_WITHIN * best.call_tokens_per_s]
    if not looks:
        return None
    pred = max(looks, key=lambda p: p.call_tokens_per_s)
    ctl.memory.untried_looks.add(family(pred.plan))
    return _explore(ctl, pred, best, preds, f"a look at {pred.plan.label} ({pred.call_tokens_per_s:.2f} tok/s, "
                    f"within {1 - UNTRIED_LOOK_WITHIN:.0%} of the choice): it has not run, its price is extrapolated "
                    f"from its family's other plans, and its compiles are still the warm-up's")


def neighbour_look(ctl: Controller, preds: list[Prediction], best: Prediction) -> Decision | None:
    """The faster-predicted of the untried plans one K above and below `best`'s (itself measured; same family,
    precision, budget and threads), where it is predicted within NEIGHBOUR_LOOK_WITHIN of `best` and needs nothing
    compiled; once per plan."""
    plan = best.plan
    if plan.mode == "plain" or not ctl.measured(plan):
        return None
    looks = [pred for pred in preds
             if abs(pred.plan.K - plan.K) == 1 and replace(pred.plan, K=plan.K) == plan and not ctl.measured(pred.plan)
             and pred.plan not in ctl.memory.neighbour_looks and pred.parts.get("compile", 0.0) <= 0
             and pred.call_tokens_per_s >= NEIGHBOUR_LOOK_WITHIN * best.call_tokens_per_s]
    if not looks:
        return None
    pred = max(looks, key=lambda p: p.call_tokens_per_s)
    ctl.memory.neighbour_looks.add(pred.plan)
    return _explore(ctl, pred, best, preds, f"a look at {pred.plan.label} ({pred.call_tokens_per_s:.2f} tok/s, "
                    f"within {1 - NEIGHBOUR_LOOK_WITHIN:.0%} of the choice): the K next to the choice's has not run, "
                    f"and the cost lines' price of one more or one less step is the least sure part of it")


def _explore(ctl: Controller, pred: Prediction, best: Prediction, preds: list[Prediction], why: str) -> Decision:
    """Run `pred`'s plan to measure it (kept mid-call while `still_exploring`), priced against `best`."""
    ctl.memory.exploring = pred.plan
    table = [pred, *(p for p in preds[:6] if p is not pred)][:6]
    return Decision(pred.plan, f"{why}; {ctl.explain(best, preds)}", table, pred, choice=best.plan)


def second_look(ctl: Controller, preds: list[Prediction], best: Prediction) -> Decision | None:
    """The fastest plan other than `best` that at most one call has measured, where that call may have run cold
    (`may_run_cold`; calls that compiled its graphs do not count: Memory.cold), or whose last measurement is
    STALE_LOOK_ROUNDS old, where it is predicted within
    SECOND_LOOK_WITHIN of `best` and needs nothing compiled; once per plan, once more after a call that compiled
    its graphs, and once each time its price goes stale (one stale look per STALE_LOOK_ROUNDS, all plans
    together). Its earlier calls' means are dropped, so the looked-at call's rounds price it (a call-start price is
    the median of the last calls' means).

    Only where `best` has been measured itself: an untried best is measured by running it, and a second look
    before it spends a call on the plan it is predicted to beat (with compile, calls that compile nothing
    extra are few: control.compiled)."""
    if not ctl.measured(best.plan):
        return None
    for pred in preds:  # fastest first
        if pred.call_tokens_per_s < SECOND_LOOK_WITHIN * best.call_tokens_per_s:
            return None
        ema = ctl.memory.round_s.get(pred.plan)
        if pred is best or ema is None or not ctl.measured(pred.plan) or pred.parts.get("compile", 0.0) > 0:
            continue
        age = ctl.memory.age(pred.plan)
        stale = age >= STALE_LOOK_ROUNDS and ctl.memory.clock - ctl.memory.stale_look_at >= STALE_LOOK_ROUNDS
        if not stale and (pred.plan in ctl.memory.second_looks or len(ema.calls) > 1 or ema.call_n
                          or not may_run_cold(ctl, pred.plan)):
            continue
        if stale:
            ctl.memory.stale_look_at = ctl.memory.clock
        ctl.memory.second_looks.add(pred.plan)
        ema.forget_calls()
        why = (f"its price is {age} rounds old, and the machine's speed drifts" if stale
               else "one call measured it, and a plan's first call is its coldest")
        return _explore(ctl, pred, best, preds, f"a second look at {pred.plan.label} ({pred.call_tokens_per_s:.2f} "
                        f"tok/s, within {1 - SECOND_LOOK_WITHIN:.0%} of the choice): {why}")
    return None


def may_run_cold(ctl: Controller, plan: Plan) -> bool:
    """Can `plan`'s first call run slower than its later ones? On a draft process (a fresh one touches its weights
    first), or with compiled forwards (their first runs); an eager plan in this process runs warm."""
    if plan.worker == "process":
        return True
    return ctl.plain_compiled if plan.mode == "plain" else ctl.draft_compiled or ctl.plain_compiled


def still_exploring(ctl: Controller, current: Plan) -> bool:
    """Is the running plan one a call runs to measure it, and not yet measured enough to leave? An explored family's
    plan until its rounds price it (MIN_ROUNDS), a second look for SECOND_LOOK_ROUNDS of its own call."""
    if current != ctl.memory.exploring:
        return False
    if not ctl.measured(current):
        return True
    return current in ctl.memory.second_looks and ctl.memory.round_s[current].call_n < SECOND_LOOK_ROUNDS


def alpha_exploration(ctl: Controller, preds: list[Prediction], plain: Prediction,
                 best: Prediction | None) -> Decision | None:
    """`best` (the fastest drafting plan) instead of plain while α rests on too few rounds (EXPLORE_ROUNDS), if
    it is predicted within EXPLORE_WITHIN of plain; None when α is known (measured, or fixed by the options)."""
    if ctl.fixed_alpha is not None or ctl.memory.alpha_rounds >= EXPLORE_ROUNDS:
        return None
    if best is None or best.call_tokens_per_s < EXPLORE_WITHIN * plain.call_tokens_per_s:
        return None
    reason = (f"exploring {best.plan.label}: alpha rests on {ctl.memory.alpha_rounds} drafting rounds (plain "
              f"decoding measures none); {ctl.explain(plain, preds)}")
    return Decision(best.plan, reason, preds[:6], best)


def plain_measurement(ctl: Controller, decision: Decision, horizon: Horizon) -> Plan | None:
    """The drafting plan whose draft should measure α along the answer of a call that runs plain
    (control.plain_acceptance), or None: only where drafting is predicted within MEASURE_WITHIN of plain (so a
    better α could change the choice), at most once every MEASURE_EVERY calls, and where the draft's pass over the
    call's context and answer is predicted to cost at most MEASURE_SHARE of those calls' decoding. Never with a
    fixed α."""
    plain, drafting = next((p for p in decision.table if p.plan == decision.plan), None), decision.drafting
    if ctl.fixed_alpha is not None or plain is None or plain.plan.mode != "plain" or drafting is None:
        return None
    if drafting.call_tokens_per_s < MEASURE_WITHIN * plain.call_tokens_per_s:
        return None
    if ctl.memory.calls < ctl.memory.plain_measured_call + MEASURE_EVERY:
        return None
    decoding_s = horizon.tokens * ctl.batch / max(plain.tokens_per_s, 1e-9)
    ratio = ctl.memory.startup_ratio("sync")  # a pass of the draft alone, after the target's
    draft = ctl.costs.draft(False, drafting.plan.int8)
    pass_s = (draft(horizon.context) + math.ceil(horizon.tokens / CHUNK) * draft(CHUNK)) * ratio  # as measure() runs
    if pass_s > MEASURE_SHARE * MEASURE_EVERY * decoding_s:  # its share of the calls it serves
        return None
    ctl.memory.plain_measured_call = ctl.memory.calls
    return drafting.plan
