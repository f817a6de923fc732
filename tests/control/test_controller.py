"""The controller, driven with injected costs and acceptance (deterministic): it picks the cheaper exact plan,
reacts when costs change, never picks a plan predicted more than 5% slower than another, and its switches
mid-generation keep the output exact."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from hf_ssd.control import drafter as drafter_mod
from hf_ssd.control.calibration import calibration, tail_share
from hf_ssd.control.compiled import COMPILE_FREE_CALLS
from hf_ssd.control.controller import Controller
from hf_ssd.control.memory import Ema, Memory, TailShare
from hf_ssd.control.costs import Costs, Curve
from hf_ssd.control.plan import Acceptance, Plan, candidates, predict, verify_s
from hf_ssd.testing import get_pair, left_pad, plain_generate, prompt


def costs(verify=(0.10, 0.002), draft=(0.02, 0.0005), split=1.0, batch=1, int8=None) -> Costs:
    """Cost lines in seconds: (fixed, per token). `split` scales both sides when they share the machine."""
    t, d = Curve.straight(*verify), Curve.straight(*draft)
    ts, ds = Curve.straight(*(split * x for x in verify)), Curve.straight(*(split * x for x in draft))
    q = None if int8 is None else Curve.straight(*int8)
    return Costs(batch, t, d, ts, ds, (1, 1), q, q)


def controller(c: Costs, alpha: float, allowed: dict | None = None, batch: int = 1) -> Controller:
    return Controller(c, Memory(), batch, allowed or {}, fixed_alpha=alpha)


def test_cheap_draft_good_acceptance_picks_ssd():
    d = controller(costs(), alpha=0.8).decide()
    assert d.plan.mode == "ssd"
    assert "predicted" in d.reason


def test_no_spare_hardware_picks_sync():
    # Running both sides at once halves each side's speed (one core shared): the tree cannot hide.
    d = controller(costs(split=2.0), alpha=0.8).decide()
    assert d.plan.mode == "sync"


def test_useless_draft_picks_plain():
    d = controller(costs(draft=(0.08, 0.002)), alpha=0.05).decide()
    assert d.plan == Plan("plain")


def test_int8_draft_chosen_when_cheaper():
    c = costs(draft=(0.04, 0.001), int8=(0.012, 0.0003))
    assert controller(c, alpha=0.8).decide().plan.int8
    assert not controller(c, 0.8, {"int8": False}).decide().plan.int8


def test_explicit_options_win():
    c = costs(split=2.0)
    d = controller(c, 0.8, {"mode": ("ssd",), "K": (3,), "budget": 8}).decide()
    assert (d.plan.mode, d.plan.K, d.plan.budget) == ("ssd", 3, 8)
    assert controller(c, 0.8, {"mode": ("sync",)}).decide().plan.mode == "sync"


def test_never_picks_a_plan_predicted_more_than_5_percent_slower():
    rng = random.Random(0)
    for _ in range(200):
        c = costs(verify=(rng.uniform(0.01, 1), rng.uniform(0, 0.05)), draft=(rng.uniform(0.001, 0.5), rng.uniform(0, 0.02)),
                  split=rng.uniform(0.8, 2.5), batch=rng.choice([1, 4, 16]))
        ctl = controller(c, rng.uniform(0.05, 0.99), batch=c.batch)
        chosen = ctl.decide()
        best = max(ctl.predict(p).tokens_per_s for p in ctl.plans)
        assert ctl.predict(chosen.plan).tokens_per_s >= 0.95 * best


def test_reacts_when_costs_change_mid_generation():
    ctl = controller(costs(), alpha=0.8)
    first = ctl.decide().plan
    assert first.mode == "ssd"
    # The plan runs, and its rounds turn out 5x slower than modelled (e.g. the machine got busy on the draft core).
    slow = Ema()
    slow.add(5 * predict(first, ctl.costs, Acceptance(alpha=0.8), 1).round_s, count=8)
    ctl.memory.round_s[first] = slow
    second = ctl.decide(current=first)
    assert second.plan != first
    assert ctl.predict(second.plan).tokens_per_s > ctl.predict(first).tokens_per_s


def test_an_old_measurement_is_rechecked_at_the_start_of_a_call():
    """Plain was measured slower than sync SD, long ago (a slow spell, say); sync has run since. At the start of a
    call the old measurement counts less, leaning toward the model, so plain is tried again; mid-generation it is
    not (a switch costs a restart). Measured slow again, plain is left alone: a fresh measurement is believed."""
    from hf_ssd.control.calibration import STALE_HALF_LIFE

    ctl = controller(costs(draft=(0.05, 0.001)), alpha=0.5, allowed={"mode": ("plain", "sync"), "K": (2,)})
    plain, sync = Plan("plain"), Plan("sync", 2)
    assert ctl.predict(plain).tokens_per_s > ctl.predict(sync).tokens_per_s  # the model: plain is faster
    slow_plain = 1.5 * ctl.model(plain).round_s
    sync_s = ctl.predict(sync).tokens_per_round / (1.2 * ctl.predict(plain).tokens_per_round / slow_plain)
    ctl.memory.record_round(plain, slow_plain, count=8)
    ctl.memory.record_round(sync, sync_s, tokens=ctl.predict(sync).tokens_per_round, count=8)
    assert ctl.decide().plan == sync  # measured: sync 1.2x the (slow) plain; both fresh
    ctl.memory.record_round(sync, sync_s, count=8, rounds=3 * STALE_HALF_LIFE)  # sync ran on and on
    decision = ctl.decide()
    assert decision.plan == plain and "re-checking" in decision.reason
    assert ctl.decide(current=sync).plan == sync
    ctl.memory.record_round(plain, slow_plain, count=8)  # the re-check: just as slow
    assert ctl.decide().plan == sync

    # Measured 2x slower than sync: however old, the cost model's word alone does not bring it back (drift is tens
    # of percent; the model, uncalibrated for plain, can be off by more).
    ctl.memory.record_round(plain, 2.4 * slow_plain, count=8)
    ctl.memory.record_round(sync, sync_s, count=8, rounds=20 * STALE_HALF_LIFE)
    assert ctl.decide().plan == sync


def test_a_calls_own_acceptance_moves_alpha_off_the_pooled_one():
    """α mid-call: this call's accepted drafts behind the setting's pooled α as their prior. A code answer accepted
    at 0.97 after chat answers at 0.7 is priced near 0.97 within a few rounds; a new call starts from the pool."""
    memory = Memory()
    memory.add_acceptance(700.0, 300.0, rounds=1000)  # many earlier calls at α = 0.7
    ctl = Controller(costs(), memory, 1, {})
    assert ctl.acceptance().alpha == pytest.approx(0.7, abs=0.01)
    for _ in range(10):  # ten rounds of K=3, every draft accepted
        ctl.observe_acceptance(3.0, 0.0)
    assert ctl.acceptance().alpha > 0.9
    assert Controller(costs(), memory, 1, {}).acceptance().alpha == pytest.approx(0.7, abs=0.02)  # the next call


def test_each_prompt_weighs_alike_in_the_alpha_the_next_call_starts_from():
    """A prompt's drafts are not independent draws of one α (the default pair accepted 0.95 along one MT-Bench answer,
    0.78 along the next): one long easy answer must not set the α later calls start from. Each call counts at most
    CALL_EVIDENCE observations per prompt row, the running one too; a batch's rows are prompts of their own."""
    from hf_ssd.control.memory import CALL_EVIDENCE

    memory = Memory()
    for accepted, rejected in ((14.0, 6.0), (570.0, 30.0), (15.0, 5.0)):  # α 0.7, a long answer at 0.95, then 0.75
        memory.add_acceptance(accepted, rejected)
        memory.end_call()
    per_call = [(0.7, 20.0), (0.95, 600.0), (0.75, 20.0)]
    capped = [(a, min(n, CALL_EVIDENCE)) for a, n in per_call]
    expected = (sum(a * n for a, n in capped) + 0.7 * 8.0) / (sum(n for _, n in capped) + 8.0)
    assert memory.alpha(0.7) == pytest.approx(expected)
    assert memory.alpha(0.7) < 0.8  # per token, the long answer alone set it at 0.93
    assert memory.tallies[False].accepted == 599.0  # every draft is still counted
    memory.add_acceptance(950.0, 50.0)  # the running call: a long easy answer so far
    assert memory.alpha(0.7) == pytest.approx((sum(a * n for a, n in capped) + 0.95 * CALL_EVIDENCE + 0.7 * 8.0)
                                              / (sum(n for _, n in capped) + CALL_EVIDENCE + 8.0))
    batch = Memory()
    ctl = Controller(costs(), batch, 16, {})
    for _ in range(20):
        ctl.observe_acceptance(45.6, 2.4, rows=16)  # sixteen prompts at α = 0.95
    batch.end_call()
    assert batch.alpha(0.7) == pytest.approx((0.95 * 16 * CALL_EVIDENCE + 0.7 * 8.0) / (16 * CALL_EVIDENCE + 8.0))


def test_alpha_is_kept_per_draft_precision():
    """The int8 draft's rounds measure the int8 draft: the default pair's accepts ~0.1 less than its fp32 weights at
    T = 0.7. A precision not yet run is priced at the α of the one that ran; once both ran, each has its own, and a
    call's rounds move only their own precision's α."""
    memory = Memory()
    memory.add_acceptance(550.0, 450.0, rounds=1000, int8=True, rows=100)  # the int8 draft at α = 0.55, 100 prompts
    assert memory.alpha(0.7, int8=False) == pytest.approx(0.55, abs=0.01)  # fp32 not run: priced as int8
    memory.add_acceptance(80.0, 20.0, rounds=100, int8=False, rows=100)  # fp32 at α = 0.8 over 100 rounds
    assert memory.alpha(0.7, int8=False) == pytest.approx(0.8, abs=0.025)
    assert memory.alpha(0.7, int8=True) == pytest.approx(0.55, abs=0.01)
    assert (memory.accepted, memory.rejected) == (630.0, 470.0)
    ctl = Controller(costs(), memory, 1, {})
    for _ in range(10):
        ctl.observe_acceptance(3.0, 0.0, int8=True)
    assert ctl.acceptance(True).alpha > 0.8
    assert ctl.acceptance(False).alpha == pytest.approx(memory.alpha(0.7, int8=False))
    plan = Plan("sync", 3)
    assert ctl.model(plan).tokens_per_round < ctl.model(Plan("sync", 3, int8=True)).tokens_per_round


def test_a_low_int8_alpha_sends_the_controller_back_to_the_full_precision_draft():
    """An int8 draft with rounds 3x cheaper wins on the shared α; measured at a far lower α than the fp32 draft's,
    the fp32 plans win: pooled together, the int8 rounds made every drafting plan look worse than plain."""
    c = costs(verify=(0.10, 0.002), draft=(0.03, 0.0005), int8=(0.01, 0.0002))
    memory = Memory()
    memory.add_acceptance(85.0, 15.0, rounds=100)  # fp32 at α = 0.85
    assert Controller(c, memory, 1, {"mode": ("sync",)}).decide().plan.int8
    memory.add_acceptance(200.0, 800.0, rounds=1000, int8=True)  # int8 at α = 0.2
    chosen = Controller(c, memory, 1, {}).decide().plan
    assert chosen.mode != "plain" and not chosen.int8


def test_only_rounds_of_the_whole_batch_price_a_plan():
    """The engine drops the rows that finished, so a batch's tail rounds are rounds of a smaller, cheaper batch:
    their time and tokens are not recorded (the plan is priced at the call's batch), their acceptance is. A round of
    every row is recorded: its time, and its tokens per row of the call."""
    from types import SimpleNamespace

    from hf_ssd.control.drafter import ControlledDrafter
    from hf_ssd.core.types import Outcome, Speculation, Verdict

    memory = Memory()
    verifies, committed, observed = [], [], []
    controller = SimpleNamespace(batch=4, record_verify=lambda p, s: verifies.append(s),
                                 record_tokens=lambda p, tokens, served: committed.append(tokens),
                                 observe_acceptance=lambda accepted, rejected, int8, rows: observed.append(accepted))

    def observe(accepted: list[int], plan: Plan, last_start: float, now: float) -> None:
        rows = len(accepted)
        fake = SimpleNamespace(memory=memory, controller=controller, plan=plan, last_start=last_start,
                               disturbed=lambda: False, _compiled_lately=lambda: False,
                               spec=Speculation(torch.zeros(rows, 2, dtype=torch.long), torch.full((rows,), 2), None,
                                                None))
        verdict = Verdict(Outcome(torch.tensor(accepted), torch.arange(rows)), torch.ones(rows, dtype=torch.bool),
                          [], [], 0.01)
        ControlledDrafter._observe(fake, verdict, now)

    observe([2, 2], Plan("sync", 2), 0.0, 0.02)  # two of the four rows left, before any full round
    assert observed == [4.0] and committed == [] and verifies == [] and memory.round_s == {}
    assert memory.tail["sync"].spent == 0.0  # nothing to compare a tail round with yet
    observe([2, 1, 0, 2], Plan("sync", 2), 0.0, 0.05)  # the whole batch
    assert committed == [pytest.approx(9 / 4)] and verifies == [0.01]
    assert memory.round_s[Plan("sync", 2)].value == pytest.approx(0.05)
    assert memory.generated == pytest.approx(9 / 4)
    observe([2, 2], Plan("sync", 2), 0.0, 0.05)  # a tail round that cost a full one for half the rows
    assert memory.round_s[Plan("sync", 2)].n == 1 and len(committed) == 1
    assert memory.tail["sync"].share == pytest.approx((0.98 * 0.05 + 0.025) / (0.98 * 0.05 + 0.05))
    # plain steps in our round loop (after a switch) are not the transformers loop a plain call runs: not recorded
    observe([0, 0, 0, 0], Plan("plain"), 0.0, 0.07)
    assert Plan("plain") not in memory.round_s and memory.clock == 1 and verifies == [0.01]



def test_rounds_that_compiled_are_not_the_plans_price():
    """A round in which our graphs compiled (in this process), or the draft's cache reports compile seconds (a draft
    process's arrive one answer late), and the round after it, are not recorded: their time is the compiler's."""
    from types import SimpleNamespace

    from hf_ssd.control.drafter import ControlledDrafter
    from hf_ssd.core.types import Outcome, Speculation, Verdict
    from hf_ssd.runtime import static_registry
    from hf_ssd.runtime.stats import SSDStats

    memory = Memory()
    controller = SimpleNamespace(batch=1, record_verify=lambda p, s: None, record_tokens=lambda p, tokens, served: None,
                                 observe_acceptance=lambda accepted, rejected, int8, rows: None)
    fake = SimpleNamespace(memory=memory, controller=controller, plan=Plan("sync", 2), last_start=0.0,
                           disturbed=lambda: False, stats=SSDStats(), compiled_last_round=False,
                           spec=Speculation(torch.zeros(1, 2, dtype=torch.long), torch.full((1,), 2), None, None))
    fake._compiles = lambda: ControlledDrafter._compiles(fake)
    fake._compiled_lately = lambda: ControlledDrafter._compiled_lately(fake)
    fake.compiles_seen = fake._compiles()
    verdict = Verdict(Outcome(torch.tensor([2]), torch.tensor([5])), torch.ones(1, dtype=torch.bool), [], [], 0.01)

    def rounds(n: int, seconds: float) -> None:
        for _ in range(n):
            ControlledDrafter._observe(fake, verdict, seconds)  # last_start stays 0: each round takes `seconds`
            fake.last_start = 0.0

    before = dict(static_registry.COMPILE_SPENT)
    try:
        static_registry.COMPILE_SPENT["graphs"] += 1  # the call's first round compiled a verify width
        rounds(2, 3.0)  # this round and the next are not recorded (they would seed the average: its first rounds)
        rounds(3, 0.010)
        sync = memory.round_s[Plan("sync", 2)]
        assert sync.n == 3 and sync.value == pytest.approx(0.01)
        fake.stats.draft_compile_s = 2.5  # the draft process's answer says it compiled
        rounds(2, 0.03)  # slower, yet not a stall the average would skip
        rounds(1, 0.010)
        assert sync.n == 4 and sync.value == pytest.approx(0.01)
    finally:
        static_registry.COMPILE_SPENT.update(before)


@pytest.mark.parametrize("regime", ["compute-bound", "launch-bound"])
def test_a_batchs_tail_is_charged_only_where_it_costs_more_than_its_rows(regime):
    """Rounds of a batch's tail (rows that finished are dropped): where a round costs in proportion to its rows
    (compute-bound), the tail does a full batch's work per second and drafting plans keep their full-round price;
    where a few rows cost nearly a full round (launch-bound), the plan's tokens are scaled by the share of its time
    that did a full batch's work. Plain decoding (every row to the end) is never scaled."""
    ctl = controller(costs(), alpha=0.8, batch=4)
    plan = Plan("sync", 3)
    ctl.memory.record_round(plan, 1.0, count=8)
    tail = ctl.memory.tail.setdefault("sync", TailShare())
    rounds = [(1.0, 1.0)] * 30 + [(rows / 4 if regime == "compute-bound" else 1.0, rows / 4)
                                  for rows in (3, 2, 1, 1) for _ in range(10)]  # (seconds, share of the rows)
    for seconds, rows_share in rounds:
        tail.add(seconds, rows_share, 1.0)
    share = tail_share(ctl.memory, plan)
    if regime == "compute-bound":
        assert share == pytest.approx(1.0)
    else:  # the rows' share of each round, the latest rounds weighing most
        weights = [0.98 ** (len(rounds) - 1 - i) for i in range(len(rounds))]
        assert share == pytest.approx(sum(w * r for w, (_, r) in zip(weights, rounds)) / sum(weights))
        assert share < 0.6
    assert ctl.predict(plan).tokens_per_round == pytest.approx(share * ctl.model(plan).tokens_per_round)
    ssd = Plan("ssd", 3, 8, "thread")  # a family that has not run a tail takes sync's share
    assert ctl.predict(ssd).tokens_per_round == pytest.approx(share * ctl.model(ssd).tokens_per_round)
    assert ctl.predict(Plan("plain")).tokens_per_round == 4.0


def test_a_family_that_has_not_run_a_tail_borrows_the_highest_measured_share():
    """At batch 4 synchronous SD's tails cost it a quarter of its time. An SSD family that never ran, or ran only
    full rounds (its calls switched away before their rows ended), would otherwise be priced at a share of 1 and
    look a third faster than sync for nothing of its own; it takes the best share the drafting families that ran
    a tail measured, until it runs a tail itself. Plain handed off to transformers' loop is priced by that loop's
    tail (rows stay on padding), never borrowed; plain steps in our loop borrow too."""
    ctl = controller(costs(), alpha=0.8, batch=4)
    thread, process = Plan("ssd", 2, 8, "thread"), Plan("ssd", 2, 8, "process")
    assert tail_share(ctl.memory, thread) == 1.0  # no tail measured anywhere
    sync_tail = ctl.memory.tail.setdefault("sync", TailShare())
    for seconds, rows_share in [(1.0, 1.0)] * 10 + [(1.0, 0.25)] * 5:
        sync_tail.add(seconds, rows_share, 1.0)
    assert 0.5 < sync_tail.share < 0.9
    thread_tail = ctl.memory.tail.setdefault("ssd:thread", TailShare())
    for _ in range(20):
        thread_tail.add(1.0, 1.0, 1.0)  # full rounds only
    assert thread_tail.share == 1.0 and not thread_tail.seen
    assert tail_share(ctl.memory, thread) == pytest.approx(sync_tail.share)
    assert tail_share(ctl.memory, process) == pytest.approx(sync_tail.share)
    thread_tail.add(0.3, 0.25, 1.0)  # its own tail, cheap: now its own share, and the best one to borrow
    assert thread_tail.seen and tail_share(ctl.memory, thread) == pytest.approx(thread_tail.share)
    assert thread_tail.share > sync_tail.share
    assert tail_share(ctl.memory, process) == pytest.approx(thread_tail.share)
    # plain handed off keeps every row to the end on padding (its own tail); in our loop it drops them, as drafting does
    assert tail_share(ctl.memory, Plan("plain")) == 1.0
    assert tail_share(ctl.memory, Plan("plain"), in_loop=True) == pytest.approx(thread_tail.share)


def test_plain_rows_that_ended_early_are_charged_too():
    """transformers' loop keeps a row that ended (end-of-sequence) on padding until every row has: a plain call in
    which a tenth of the row-steps made no token is priced at 0.9 of the model's tokens per step."""
    from hf_ssd.control.memory import record_plain

    ctl = controller(costs(), alpha=0.8, batch=4)
    record_plain(ctl.memory, 0.1, 63, rows_share=0.9)
    assert tail_share(ctl.memory, Plan("plain")) == pytest.approx(0.9)
    assert ctl.predict(Plan("plain")).tokens_per_round == pytest.approx(4 * 0.9)
    assert tail_share(ctl.memory, Plan("sync", 2)) == 1.0


def test_a_stalled_tail_round_leaves_the_tail_share_alone():
    tail = TailShare()
    tail.add(1.0, 1.0, 1.0)
    tail.add(50.0, 0.5, 1.0)  # a page fault in a tail round: not the plan's tail
    assert tail.share == 1.0


def test_round_times_shrug_off_one_off_stalls():
    """A compile (or page fault) stalls one round by 100x: neither as the first round nor later does it become the
    plan's measured speed; three slow rounds in a row do (the plan really got slower)."""
    ema = Ema()
    for x in (1.0, 100.0, 1.0, 1.0):  # a stall among the first rounds: the median starts the average
        ema.add(x)
    assert ema.value == pytest.approx(1.0)
    ema.add(100.0)  # a later stall is skipped
    assert ema.value == pytest.approx(1.0)
    ema.add(50.0, count=3)  # a lasting change is taken
    assert ema.value > 5.0


def _measured_as_modelled(ctl: Controller, plan: Plan) -> None:
    """`plan` ran 8 rounds at exactly its modelled round time (calibration 1)."""
    ctl.memory.record_round(plan, ctl.model(plan).round_s, count=8)


def test_an_untried_plan_needs_a_clear_gain_over_its_measured_siblings():
    """At the start of a call, a plan that never ran, in a family that has, is chosen over the measured plans only
    when predicted UNTRIED_GAIN faster: its prediction is the model, which is off by tens of percent for some
    shapes. With a clear gain it is still chosen (and then measured)."""
    from hf_ssd.control.exploration import UNTRIED_GAIN

    fresh = controller(costs(), alpha=0.8, allowed={"mode": ("sync",)})
    best = fresh.decide().plan
    speed = {p: fresh.predict(p).tokens_per_s for p in fresh.plans}
    close = [p for p in fresh.plans if speed[best] / UNTRIED_GAIN < speed[p] < speed[best] * 0.99]
    far = [p for p in fresh.plans if speed[p] < speed[best] / UNTRIED_GAIN * 0.99]
    assert close and far
    for sibling, expected in ((close[0], close[0]), (far[0], best)):
        ctl = controller(costs(), alpha=0.8, allowed={"mode": ("sync",)})
        _measured_as_modelled(ctl, sibling)
        assert ctl.decide().chosen == expected  # (a look at the K next to it may run instead: neighbour_look)


@pytest.mark.parametrize("split", [1.0, 1.3])
def test_a_drafting_family_that_never_ran_is_explored_once(split):
    """The first call runs the best prediction (SSD here). The next call runs the best sync plan, which has never
    run, if it is predicted within FAMILY_EXPLORE_WITHIN of the choice: its price came from the model and the
    other families' calibration. Once measured it is chosen on its measurement (here slower: SSD again)."""
    from hf_ssd.control.exploration import FAMILY_EXPLORE_WITHIN

    ctl = controller(costs(split=split), alpha=0.8)
    first = ctl.decide().plan
    assert first.mode == "ssd"
    _measured_as_modelled(ctl, first)
    sync = max((ctl.predict(p) for p in ctl.plans if p.mode == "sync"), key=lambda x: x.tokens_per_s)
    within = sync.tokens_per_s >= FAMILY_EXPLORE_WITHIN * ctl.predict(first).tokens_per_s
    assert within == (split == 1.3)  # 17.5 against 25.6 tok/s at split 1; against 19.7 at split 1.3
    second = ctl.decide()
    if not within:
        assert second.chosen == first and not second.reason.startswith("exploring")
        return
    assert second.plan == sync.plan and second.reason.startswith("exploring sync")
    assert second.chosen == first and second.table[0].plan == sync.plan  # a kept process is priced against `first`
    # mid-call, the explored plan runs until its own rounds price it, then the usual rules apply
    ctl.memory.record_round(sync.plan, 1.2 * ctl.model(sync.plan).round_s, count=2)
    assert ctl.decide(current=sync.plan).plan == sync.plan
    ctl.memory.record_round(sync.plan, 1.2 * ctl.model(sync.plan).round_s, count=6)
    assert ctl.decide().chosen == first  # (a look at first's next K may run: neighbour_look)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_plain_loop_is_explored_once_like_a_drafting_family(compiled):
    """With a compiled target, plain's price is its eager cost line scaled by the verifies' measured ratio, and
    transformers' compiled loop runs faster than that (the overhead workload at α ≈ 0.7: about 285 tok/s where the
    compiled SD ran 250, and plain was priced below it): plain is explored once, as a drafting family that never ran
    is. Eager plain is priced by its own cost line, and is not."""
    ctl = Controller(costs(split=1.3), Memory(), 1, {}, fixed_alpha=0.4, plain_compiled=compiled,
                     draft_compiled=compiled)
    assert ctl.predict(Plan("plain")).tokens_per_s < ctl.predict(ctl.decide().plan).tokens_per_s
    explored = []
    for _ in range(5):
        decision = ctl.decide()
        if decision.reason.startswith("exploring"):
            explored.append(decision.plan)
        _measured_as_modelled(ctl, decision.plan)
    assert explored.count(Plan("plain")) == int(compiled)


def test_an_exploration_never_compiles(monkeypatch):
    """A family whose graphs are not built in this process is not explored, however cheap its compiles look spread
    over a long-running setting's future: a measurement is not worth a stall of seconds."""
    from hf_ssd.control.decision import Horizon
    from hf_ssd.runtime import static_registry

    monkeypatch.setattr(static_registry, "COMPILE_SPENT", {"seconds": 30.0, "graphs": 10})
    for compiled in (False, True):
        ctl = Controller(costs(split=1.3), Memory(), 1, {}, fixed_alpha=0.8, draft_compiled=compiled,
                         max_length=200)
        horizon = Horizon(tokens=64, context=100)
        first = ctl.decide(horizon=horizon).plan
        assert first.mode == "ssd"
        ctl.mark_compiled(first)
        _measured_as_modelled(ctl, first)
        ctl.memory.calls = COMPILE_FREE_CALLS  # past the warm-up calls, which compile freely
        ctl.memory.generated = 1e6  # a long-running setting: a compile is a small share of its future
        second = ctl.decide(horizon=horizon)
        # eager: sync is explored as usual; compiled: its graphs (draft widths 1, 2) are not built
        assert second.reason.startswith("exploring sync") == (not compiled)


def test_graphs_compiled_in_this_process_by_other_calls_cost_nothing(monkeypatch):
    """As above with compiled forwards, but this process's static registry has the draft's single-step graphs
    already (an earlier `ssd_mode="sync"` call built them on caches of the right size): compiled sync is explored.
    A draft process's graphs and an int8 copy's are not looked up in this process."""
    from types import SimpleNamespace

    from hf_ssd.control.compiled import compiled_in_process
    from hf_ssd.control.decision import Horizon
    from hf_ssd.runtime import static_registry

    monkeypatch.setattr(static_registry, "COMPILE_SPENT", {"seconds": 30.0, "graphs": 10})
    target, draft = SimpleNamespace(), SimpleNamespace()
    entries = [SimpleNamespace(batch=1, max_cache_len=2 ** i, compiled_widths=set(range(1, 20))) for i in range(6, 14)]
    monkeypatch.setattr(static_registry, "registry_entries", lambda model=None: entries if model is draft else [])
    ctl = Controller(costs(split=1.3), Memory(), 1, {}, fixed_alpha=0.8, draft_compiled=True, max_length=200,
                     target=target, draft=draft)
    horizon = Horizon(tokens=64, context=100)
    first = ctl.decide(horizon=horizon).plan
    assert first.mode == "ssd"
    ctl.mark_compiled(first)
    _measured_as_modelled(ctl, first)
    ctl.memory.calls = COMPILE_FREE_CALLS
    ctl.memory.generated = 1e6
    assert ctl.decide(horizon=horizon).reason.startswith("exploring sync")
    graph = ("draft", False, False, 1, ("slots", 256))
    assert compiled_in_process(graph, target, draft, 1)
    assert not compiled_in_process(graph, target, draft, 4)  # another batch size: other caches
    assert not compiled_in_process(("draft", False, True, 1, ("slots", 256)), target, draft, 1)  # a draft process's
    assert not compiled_in_process(("draft", True, False, 1, ("slots", 256)), target, draft, 1)  # the int8 copy's
    assert not compiled_in_process(("target", 3, ("slots", 256)), target, draft, 1)  # not built for the target


def test_a_family_is_explored_once_however_few_rounds_it_recorded():
    """A call that explored sync but recorded fewer than MIN_ROUNDS of its rounds (a short call, or one measured
    while a kept process started) does not make every later call explore it again."""
    ctl = controller(costs(split=1.3), alpha=0.8)
    first = ctl.decide().plan
    _measured_as_modelled(ctl, first)
    explored = ctl.decide()
    assert explored.plan.mode == "sync"
    ctl.memory.record_round(explored.plan, ctl.model(explored.plan).round_s, count=1)
    again = ctl.decide()
    assert again.chosen == first and not again.reason.startswith("exploring")  # (a look at first's next K may run)


@pytest.mark.parametrize("cold", [0.9, 0.75, 0.6])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_plan_one_cold_call_measured_gets_a_second_look(cold, compiled):
    """A plan that one call measured (its first: fresh graphs, a fresh draft process) at `cold` x the speed of the
    choice runs one more call if that is within SECOND_LOOK_WITHIN; its cold call's mean is dropped, and the call
    keeps it for SECOND_LOOK_ROUNDS of its rounds before the usual rules. Once per plan. An eager plan in this
    process ran warm in its first call: no look (exploration.may_run_cold)."""
    from hf_ssd.control.exploration import SECOND_LOOK_ROUNDS, SECOND_LOOK_WITHIN

    ctl = controller(costs(draft=(0.05, 0.001)), alpha=0.5, allowed={"mode": ("plain", "sync"), "K": (2,)})
    ctl.draft_compiled = compiled
    plain, sync = Plan("plain"), Plan("sync", 2)
    for _ in range(3):
        ctl.memory.record_round(plain, ctl.model(plain).round_s, count=8)
        ctl.memory.end_call()
    slow = ctl.predict(sync).tokens_per_round / (cold * ctl.predict(plain).tokens_per_s)
    ctl.memory.record_round(sync, slow, count=8)
    ctl.memory.end_call()
    decision = ctl.decide()
    if cold < SECOND_LOOK_WITHIN or not compiled:
        assert decision.plan == plain
        return
    assert decision.plan == sync and decision.reason.startswith("a second look at sync K=2")
    assert decision.chosen == plain and ctl.memory.round_s[sync].calls == []
    for _ in range(SECOND_LOOK_ROUNDS - 1):  # still as slow as the cold call: kept until its own rounds say so
        ctl.memory.record_round(sync, slow)
        assert ctl.decide(current=sync).plan == sync
    ctl.memory.record_round(sync, slow)
    assert ctl.decide(current=sync).plan == plain
    ctl.memory.end_call()
    assert ctl.decide().plan == plain  # looked at twice, slower both times: not again


def test_a_plan_whose_price_went_stale_gets_another_look():
    """A plan measured over several calls, then not chosen for STALE_LOOK_ROUNDS rounds while another ran (a slow
    spell priced it; the machine's speed drifts), runs one more call if it is predicted within SECOND_LOOK_WITHIN
    of the choice; that call's rounds then price it. Not again until its price is that old once more."""
    from hf_ssd.control.exploration import STALE_LOOK_ROUNDS

    ctl = controller(costs(draft=(0.05, 0.001)), alpha=0.5, allowed={"mode": ("plain", "sync"), "K": (2,)})
    plain, sync = Plan("plain"), Plan("sync", 2)
    fast = ctl.predict(sync).tokens_per_round / (1.2 * ctl.predict(plain).tokens_per_s)  # sync, really: 1.2x plain
    for _ in range(3):  # three calls in a slow spell: 0.8x plain
        ctl.memory.record_round(sync, 1.5 * fast, count=8)
        ctl.memory.end_call()
    rounds = 0
    while rounds < STALE_LOOK_ROUNDS:  # plain runs; sync is not looked at until its price is that old
        ctl.memory.record_round(plain, ctl.model(plain).round_s, count=8)
        ctl.memory.end_call()
        rounds += 8
        decision = ctl.decide()
        assert decision.plan == (sync if rounds >= STALE_LOOK_ROUNDS else plain), rounds
    assert "rounds old" in decision.reason and ctl.memory.round_s[sync].calls == []
    ctl.memory.record_round(sync, fast, count=8)  # the machine is fast again
    ctl.memory.end_call()
    assert ctl.decide().plan == sync and "second look" not in ctl.decide().reason
    # and one in a slow spell, looked at again, is left once it measures slow again
    for _ in range(3):
        ctl.memory.record_round(sync, 1.5 * fast, count=8)
        ctl.memory.end_call()
    assert ctl.decide().plan == plain


def test_stale_plans_share_one_look_per_stale_interval():
    """Several plans within reach whose prices went stale together get one look per STALE_LOOK_ROUNDS between
    them, not one each at once: four such plans at batch 4 took 4 of 12 timed calls."""
    from hf_ssd.control.exploration import STALE_LOOK_ROUNDS

    ctl = controller(costs(draft=(0.05, 0.001)), alpha=0.5, allowed={"mode": ("plain", "sync"), "K": (1, 2)})
    plain, stale = Plan("plain"), [Plan("sync", 1), Plan("sync", 2)]
    for plan in stale:
        slow = ctl.predict(plan).tokens_per_round / (0.85 * ctl.predict(plain).tokens_per_s)  # 0.85x plain
        for _ in range(3):
            ctl.memory.record_round(plan, slow, count=8)
            ctl.memory.end_call()

    def run_plain(rounds):
        for _ in range(rounds // 8):
            ctl.memory.record_round(plain, ctl.model(plain).round_s, count=8)
            ctl.memory.end_call()

    run_plain(STALE_LOOK_ROUNDS)
    looks = []
    for _ in range(4):  # four calls in a row, both sync plans stale: one look
        decision = ctl.decide()
        looks.append(decision.plan)
        ctl.memory.record_round(decision.plan, ctl.memory.round_s[decision.plan].value, count=8)
        ctl.memory.end_call()
    assert sum(p != plain for p in looks) == 1, looks
    run_plain(STALE_LOOK_ROUNDS)
    decision = ctl.decide()
    assert decision.plan in stale and "rounds old" in decision.reason


def test_a_call_that_compiled_a_plans_graphs_does_not_price_it():
    """The plan's looked-at call compiled its graphs again (a new cache size): that call's rounds ran beside the
    compiler, so its mean is dropped and the plan may have another look; the warm call after it prices it."""
    from hf_ssd.control.exploration import SECOND_LOOK_ROUNDS

    ctl = controller(costs(draft=(0.05, 0.001)), alpha=0.5, allowed={"mode": ("plain", "sync"), "K": (2,)})
    ctl.draft_compiled = True
    plain, sync = Plan("plain"), Plan("sync", 2)
    for _ in range(3):
        ctl.memory.record_round(plain, ctl.model(plain).round_s, count=8)
        ctl.memory.end_call()
    fast = ctl.predict(sync).tokens_per_round / (1.2 * ctl.predict(plain).tokens_per_s)
    cold = fast / 0.75
    for _ in range(2):  # its first call, and its second look: both compiled
        ctl.memory.record_round(sync, cold, count=8)
        ctl.memory.cold.add(sync)
        ctl.memory.end_call()
        assert ctl.memory.round_s[sync].calls == [] and not ctl.memory.cold
        decision = ctl.decide()
        assert decision.plan == sync and decision.reason.startswith("a second look at sync K=2")
    ctl.memory.record_round(sync, fast, count=SECOND_LOOK_ROUNDS)  # warm at last
    ctl.memory.end_call()
    assert ctl.memory.round_s[sync].calls == [pytest.approx(fast, rel=0.05)]
    assert ctl.decide().plan == sync and "second look" not in ctl.decide().reason
    # a warm call of a plan looked at already: no further look
    ctl.memory.record_round(plain, ctl.model(plain).round_s, count=8)
    assert sync in ctl.memory.second_looks


def test_the_drafter_marks_the_running_plan_cold_when_graphs_compile(monkeypatch):
    """A compile seen in a round (this process's graphs, or the draft process's compile seconds) marks the running
    plan cold for the call (Memory.cold)."""
    from types import SimpleNamespace

    from hf_ssd.control.drafter import ControlledDrafter

    memory = Memory()
    compiles = [(0, 0.0)]
    plan = Plan("ssd", 2, 8, "process")
    fake = SimpleNamespace(memory=memory, plan=plan, compiled_last_round=False, compiles_seen=(0, 0.0),
                           _compiles=lambda: compiles[-1])
    assert not ControlledDrafter._compiled_lately(fake) and not memory.cold
    compiles.append((0, 3.5))  # the draft process reported a compile with its answer
    assert ControlledDrafter._compiled_lately(fake) and memory.cold == {plan}


def test_an_untried_choice_runs_before_a_second_look():
    """The choice (sync K = 3) has not run: it is measured by running it, not after a second look at the K = 2
    that one cold call measured at 0.85x its prediction (which spent one of the few calls that compile freely)."""
    ctl = controller(costs(draft=(0.01, 0.0002)), alpha=0.95, allowed={"mode": ("sync",), "K": (2, 3)})
    ctl.draft_compiled = True
    k2, k3 = Plan("sync", 2), Plan("sync", 3)
    ctl.memory.record_round(k2, ctl.model(k2).round_s / 0.85, count=8)
    ctl.memory.end_call()
    first = ctl.decide()
    assert first.plan == k3 and "second look" not in first.reason
    ctl.memory.record_round(k3, ctl.model(k3).round_s, count=8)
    ctl.memory.end_call()
    assert ctl.decide().reason.startswith("a second look at sync K=2")  # now the choice is measured

def test_one_call_in_a_slow_spell_does_not_rule_a_plan_out():
    """A plan's price at the start of a call is the median of its last calls' mean round times: a call that ran
    in a slow spell (the machine's speed drifts by tens of percent) does not make the plan look slow for good.
    Mid-call the recent rounds rule, so a plan that really got slower is still left within a few rounds."""
    ctl = controller(costs(draft=(0.05, 0.001)), alpha=0.5, allowed={"mode": ("plain", "sync"), "K": (2,)})
    plain, sync = Plan("plain"), Plan("sync", 2)
    for _ in range(2):  # plain as the model says, in two calls (one would earn it a second look)
        ctl.memory.record_round(plain, ctl.model(plain).round_s, count=8)
        ctl.memory.end_call()
    fast = ctl.predict(sync).tokens_per_round / (1.2 * ctl.predict(plain).tokens_per_s)  # sync 1.2x plain
    for seconds in (fast, fast, 2 * fast):  # two calls, then one in a slow spell
        ctl.memory.record_round(sync, seconds, count=8)
        ctl.memory.end_call()
    assert ctl.memory.round_s[sync].settled == pytest.approx(fast)
    assert ctl.predict(sync).tokens_per_s < ctl.predict(plain).tokens_per_s  # the recent rounds: sync looks slow
    assert ctl.decide().plan == sync
    ctl.memory.record_round(sync, 2 * fast, count=8)  # slow again, and again: it is slower now
    ctl.memory.end_call()
    assert ctl.decide().plan == plain


def test_equal_predictions_prefer_the_smaller_tree():
    """When the tree's cost does not grow with its width (a launch-bound draft) and every budget hits alike, the
    controller takes the smallest budget among those within 3% of the fastest, not the largest."""
    flat = costs(verify=(0.10, 0.0), draft=(0.01, 0.0))
    ctl = controller(flat, alpha=1.0, allowed={"mode": ("ssd",), "K": (4,)})
    chosen = ctl.decide().plan
    fastest = max(ctl.predict(p).tokens_per_s for p in ctl.plans)
    near = [p for p in ctl.plans if ctl.predict(p).tokens_per_s >= 0.97 * fastest]
    assert chosen.budget == min(p.budget for p in near) and chosen.budget < 64


def test_a_bonus_that_is_always_the_first_guess_shrinks_the_tree():
    """With the prior guessability (the bonus outside the draft's top F in 0.5/F of rounds) a wider tree buys hit
    rate, so the controller picks a budget well above K + 1. Once SSD's rounds show the bonus is the first guess every
    time (α = 1: the draft is the target's first layers), only k = K occurs and the narrowest tree wins, narrower than
    the K + 1 outcomes (hand-picked on the overhead workload, 2 branches beat K + 1 at K = 8). Where acceptance spreads
    the outcomes (α = 0.6), a tree that covers them wins again."""
    launch_bound = costs(verify=(0.010, 0.0002), draft=(0.005, 0.000001))
    ctl = controller(launch_bound, alpha=1.0, allowed={"mode": ("ssd",), "K": (4,)})
    assert ctl.decide().plan.budget > 6
    ctl.memory.guessability.add([400] + [0] * 16)  # 400 bonus tokens, all of rank 0
    assert ctl.acceptance().top1_miss < 0.1
    ctl.memory.shortlist = None  # a full evaluation (the shortlist was made on the prior, where wide trees led)
    assert ctl.decide().plan.budget == 2  # the narrowest candidate
    spread = controller(launch_bound, alpha=0.6, allowed={"mode": ("ssd",), "K": (4,)})
    spread.memory.guessability.add([400] + [0] * 16)
    assert spread.decide().plan.budget >= 5


def test_guessability_is_learned_from_the_ranks():
    ctl = controller(costs(), alpha=0.7)
    assert (ctl.acceptance().r, ctl.acceptance().top1_miss) == (1.0, 0.5)  # the prior
    ctl.memory.guessability.add([200, 200] + [0] * 15)  # the bonus is the first or second guess: no slope to fit
    acc = ctl.acceptance()
    assert acc.r == pytest.approx(1.0) and acc.top1_miss == pytest.approx(0.5, abs=0.03)
    flat = controller(costs(), alpha=0.7)
    flat.memory.guessability.add([200] + [0] * 15 + [200])  # half outside every guess: more guesses do not help
    assert flat.acceptance().r < 0.2


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_ssd_rounds_teach_the_controller_how_guessable_the_bonus_is(monkeypatch, worker):
    """The ranks an SSD drafter counts (in this process or in its worker process) reach the controller's memory."""
    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.control import memory as memory_mod

    monkeypatch.setattr(memory_mod, "_MEMORY", {})
    # one plan throughout (K and budget chosen from a loaded machine's timings made too few rounds, or a switch)
    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None: ctl_mod.Decision(
        Plan("ssd", 2, 6, worker), "test: fixed", []))
    pair = get_pair("llama")
    ids, mask = left_pad([prompt(7, seed=3)[0]])
    ref = plain_generate(pair.target, ids, attention_mask=mask, max_new_tokens=24)
    out = pair.target.generate(ids, attention_mask=mask, assistant_model=pair.related, ssd=True, max_new_tokens=24,
                               do_sample=False, pad_token_id=0, ssd_mode="ssd", ssd_worker=worker,
                               ssd_backup="ngram", return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    (memory,) = memory_mod._MEMORY.values()
    assert memory.guessability.fit is not None
    # the rounds the draft proposed (not those after a miss, served by a backup, nor one whose outcome went to a
    # switch of plan, which a loaded machine's timings may choose), but the last, whose ranks would be read at the
    # next round; slightly decayed (Guessability's window)
    switches = len(out.ssd_stats["controller"].get("switches") or [])
    proposed = out.ssd_stats["rounds"] - 1 - sum(out.ssd_stats["backup_rounds"].values()) - switches
    assert proposed >= 5 and memory.guessability.estimator.n >= 0.95 * proposed
    # ... and so do the seconds its trees and verifies took (control.learned_line: they price compiled plans)
    tree = memory.lines[("draft", f"ssd:{worker}", False)]
    (at,) = tree.points
    assert at == pytest.approx(3 + 0.03 * 2 * 5) and tree.points[at].n >= 3 and 0 < tree(at) < 5.0
    assert [key for key in memory.lines if key[0] == "verify"]


def test_small_gains_do_not_switch():
    ctl = controller(costs(), alpha=0.8)
    first = ctl.decide().plan
    ema = Ema()
    ema.add(1.05 * predict(first, ctl.costs, Acceptance(alpha=0.8), 1).round_s, count=8)
    ctl.memory.round_s[first] = ema
    assert ctl.decide(current=first).plan == first


def test_candidates_cover_modes_and_skip_inline_ssd():
    plans = candidates(costs())
    assert {p.mode for p in plans} == {"plain", "sync", "ssd"}
    assert all(p.worker == "thread" for p in plans if p.mode == "ssd")


# ---- exactness while the controller switches plans mid-generation ------------------------------------------------
# sync K=2 -> 5 and K=4 -> 1 change K alone: the draft keeps its cache (retune), every other switch restarts it
PLANS = [Plan("ssd", 3, 6, "thread"), Plan("sync", 2), Plan("sync", 5), Plan("plain"), Plan("ssd", 4, 8, "inline"),
         Plan("sync", 4), Plan("sync", 1)]


@pytest.fixture
def switching(monkeypatch):
    """A controller that moves to the next plan of PLANS at every decision point."""
    from hf_ssd.control import controller as ctl_mod

    def decide(self, current=None, horizon=None):
        i = 0 if current is None else (PLANS.index(current) + 1) % len(PLANS)
        return ctl_mod.Decision(PLANS[i], "test: rotate", [])

    monkeypatch.setattr(ctl_mod.Controller, "decide", decide)
    monkeypatch.setattr(drafter_mod, "CONFIRMATIONS", 1)
    monkeypatch.setattr(drafter_mod, "DECIDE_EVERY", 4)
    monkeypatch.setattr(drafter_mod.ControlledDrafter, "_switch_could_pay", lambda self, verdict: True)  # to the end
    # deciding's own measured time must not space decisions out (one stall in the fake decide skipped the rest)
    monkeypatch.setattr(drafter_mod, "DECIDE_SHARE", 1e9)


@pytest.mark.parametrize("alternate", [True, False])
def test_a_switch_mid_generation_needs_the_same_plan_decided_twice(monkeypatch, alternate):
    """A mid-generation switch restarts the draft: one decision that wants another plan (a slow spell in the
    running plan's rounds) is not enough; CONFIRMATIONS decisions in a row must want the same one."""
    from hf_ssd.control import controller as ctl_mod

    first, others = Plan("sync", 2), [Plan("sync", 3), Plan("plain")]
    calls = []

    def decide(self, current=None, horizon=None):
        calls.append(current)
        if current is None:
            return ctl_mod.Decision(first, "test: start", [])
        return ctl_mod.Decision(others[len(calls) % 2] if alternate else others[0], "test: other", [])

    monkeypatch.setattr(ctl_mod.Controller, "decide", decide)
    monkeypatch.setattr(drafter_mod, "DECIDE_EVERY", 1)  # a decision every round
    monkeypatch.setattr(drafter_mod, "DECIDE_SHARE", 1e9)
    pair = get_pair("llama")
    ids = prompt(6, seed=12)
    ref = plain_generate(pair.target, ids, max_new_tokens=40)
    out = pair.target.generate(ids, assistant_model=pair.related, ssd=True, max_new_tokens=40, do_sample=False,
                               pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    switches = out.ssd_stats["controller"]["switches"]
    assert len(calls) > 4
    if alternate:
        assert switches == []
    else:
        assert [(s["round"], s["to"]) for s in switches] == [(drafter_mod.CONFIRMATIONS, "sync K=3")]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_greedy_identical_while_switching(switching, arch):
    pair = get_pair(arch)
    ids, mask = left_pad([prompt(7, seed=3)[0], prompt(4, seed=4)[0]])
    ref = plain_generate(pair.target, ids, attention_mask=mask, max_new_tokens=60)
    out = pair.target.generate(ids, attention_mask=mask, assistant_model=pair.related, ssd=True, max_new_tokens=60,
                               do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    switches = out.ssd_stats["controller"]["switches"]
    assert len(switches) >= 3 and {s["to"] for s in switches} >= {"sync K=2", "plain"}


@pytest.mark.parametrize("static", [False, True])
def test_changing_only_k_keeps_the_drafts_cache(monkeypatch, static):
    """A switch between synchronous plans that differ only in K changes the number of draft steps and keeps the
    draft's cache: no restart and no second prefill (a 1.5B pair's prefill costs half a second on a CPU), and the
    output stays plain generate()'s. A static draft cache (ssd_compile) is sized for the controller's largest K."""
    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.draft.model import DraftModel
    from hf_ssd.runtime import static_kv

    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)  # the static path, eagerly: no compile time in CI

    Ks = [2, 5, 1, 3, 8]

    def decide(self, current=None, horizon=None):
        K = Ks[0] if current is None else Ks[(Ks.index(current.K) + 1) % len(Ks)]
        return ctl_mod.Decision(Plan("sync", K), "test: rotate K", [])

    prefills = []
    real_prefill = DraftModel.prefill
    monkeypatch.setattr(DraftModel, "prefill", lambda self, *a, **kw: prefills.append(1) or real_prefill(self, *a, **kw))
    monkeypatch.setattr(ctl_mod.Controller, "decide", decide)
    monkeypatch.setattr(drafter_mod, "DECIDE_EVERY", 1)
    monkeypatch.setattr(drafter_mod, "DECIDE_SHARE", 1e9)  # every round decides, however long deciding takes
    monkeypatch.setattr(drafter_mod, "CONFIRMATIONS", 1)
    # to the call's last round: the K it ends on then drafts no further than the call's length
    monkeypatch.setattr(drafter_mod.ControlledDrafter, "_switch_could_pay", lambda self, verdict: True)
    pair = get_pair("llama")
    ids, mask = left_pad([prompt(7, seed=5)[0], prompt(3, seed=6)[0]])
    ref = plain_generate(pair.target, ids, attention_mask=mask, max_new_tokens=50)
    # the target drafts for itself: with the draft's context intact after every retune, every draft is accepted
    out = pair.target.generate(ids, attention_mask=mask, assistant_model=pair.target, ssd=True, max_new_tokens=50,
                               do_sample=False, pad_token_id=0, return_dict_in_generate=True, ssd_compile=static)
    assert torch.equal(out.sequences, ref)
    s = out.ssd_stats
    assert s["draft_static"] == static
    assert len(s["controller"]["switches"]) >= 5 and {w["to"] for w in s["controller"]["switches"]} == {
        f"sync K={K}" for K in Ks}
    assert len(prefills) == 1  # the prompt's only
    assert s["accepted"] == s["drafted"], s["accept_hist"]


def test_a_static_sync_cache_is_not_retuned_past_its_size():
    """A static draft cache has room for the K it was built for: retune refuses more (the caller then builds a new
    drafter), and accepts fewer."""
    from types import SimpleNamespace

    from hf_ssd.draft.sync import SyncDrafter

    static = SyncDrafter(SimpleNamespace(kv=SimpleNamespace(static=True)), 4, None)
    assert not static.retune(5) and static.K == 4
    assert static.retune(2) and static.K == 2 and static.retune(4)
    dynamic = SyncDrafter(SimpleNamespace(kv=SimpleNamespace()), 4, None)
    assert dynamic.retune(8) and dynamic.K == 8 and not dynamic.retune(0)


def test_a_k_only_switch_is_not_charged_a_restart():
    """Pricing a switch: a plan that restarts the draft pays its prefill over what is left of the call; a
    synchronous plan with another K does not (it keeps the cache)."""
    from hf_ssd.control.decision import Horizon, retunable
    from hf_ssd.control.memory import memory_for

    assert retunable(Plan("sync", 3), Plan("sync", 7))
    assert not retunable(Plan("sync", 3), Plan("sync", 7, int8=True))
    assert not retunable(Plan("sync", 3), Plan("ssd", 3, 6, "thread"))
    assert not retunable(None, Plan("sync", 3))
    ctl = Controller(costs(), memory_for(("retune-test",)), 1, {"mode": ("sync",)})
    decision = ctl.decide(Plan("sync", 3), Horizon(tokens=64, context=400))
    startups = {p.plan: p.startup_s for p in decision.table}
    assert startups and all(s == 0.0 for plan, s in startups.items() if not plan.int8)


def test_cache_off_warns_once():
    pair = get_pair("llama")
    ids = prompt(6, seed=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pair.target.generate(ids, assistant_model=pair.shallow, ssd=True, ssd_mode="ssd", ssd_num_draft_tokens=3,
                             ssd_budget=1, ssd_worker="inline", max_new_tokens=30, do_sample=False, pad_token_id=0)
    msgs = [str(w.message) for w in caught if "effectively disabled" in str(w.message)]
    assert len(msgs) == 1 and "budget is 1" in msgs[0]


@pytest.mark.parametrize("do_sample", [False, True])
def test_plain_choice_runs_transformers_own_loop(monkeypatch, do_sample):
    """When the controller's first choice is plain decoding, generate() runs transformers' own decoding loop (faster
    than our round loop with no drafts): the output is plain generate()'s (same seed, same samples), the streamer
    sees the prompt once, every token and one end, and ssd_stats say why."""
    from transformers.generation.streamers import BaseStreamer

    from hf_ssd.control import controller as ctl_mod

    monkeypatch.setattr(ctl_mod.Controller, "decide",
                        lambda self, current=None, horizon=None: ctl_mod.Decision(Plan("plain"), "test: plain is fastest", []))

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ends += 1

    p = get_pair("llama")
    ids, mask = left_pad([prompt(7, seed=50)[0]])
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=do_sample, pad_token_id=0)
    if do_sample:
        kw.update(temperature=0.8, top_k=20)
    torch.manual_seed(7)
    ref = p.target.generate(ids, **kw)
    torch.manual_seed(7)
    streamer = Recorder()
    with torch.no_grad():
        out = p.target.generate(ids, assistant_model=p.related, ssd=True, streamer=streamer,
                                return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    st = out.ssd_stats
    assert st["mode"] == "plain" and st["rounds"] == 0 and "transformers' own decoding loop" in st["controller"]["reason"]
    assert st["per_row"]["rounds"] == [0]  # one entry per row, as with every other plan
    # the same controller record as a drafter's call (the decision is the test's, with an empty table)
    assert st["controller"]["choice"] == "plain" and st["controller"]["predicted"] == []
    assert streamer.ends == 1 and streamer.puts[0] == ids[0].tolist()
    assert sum(streamer.puts[1:], []) == ref[0, ids.shape[1]:].tolist()


def test_a_measured_speed_up_carries_over_to_families_that_have_not_run():
    """Compiled forwards beat the eager cost lines for every plan alike: when the plans that ran are measured 2x
    faster than modelled, a family that has not run is predicted 2x faster too (so it gets tried); a measured
    slow-down stays with its own family."""
    ctl = controller(costs(), alpha=0.8)
    sync = Plan("sync", 4)
    fast = Ema()
    fast.add(0.5 * ctl.model(sync).round_s, count=8)
    ctl.memory.round_s[sync] = fast
    ssd = Plan("ssd", 4, 8, "thread", threads=(1, 1))
    assert ctl.predict(ssd).round_s == pytest.approx(0.5 * ctl.model(ssd).round_s)
    assert calibration(ctl, "sync") == pytest.approx(0.5)
    slow = Ema()
    slow.add(3.0 * ctl.model(sync).round_s, count=8)
    ctl.memory.round_s[sync] = slow
    assert ctl.predict(ssd).round_s == pytest.approx(ctl.model(ssd).round_s)


def test_sync_slow_downs_price_the_ssd_families_that_have_not_run():
    """The verify and the draft's forwards are the same forwards in every family: where synchronous SD's rounds
    (which run them alone) measured them slower than the cost lines (long prompts; the lines are timed over a short
    context), an SSD family that has not run is priced with those parts slowed alike, while a whole-round
    slow-down stays with its family (test above). Not the other way: an SSD verify beside its tree is slowed by the
    tree too, and that prices no other family (priced into sync, `ssd=True` stayed on SSD at 0.77x our SD). Plain's
    hand-off is another loop and is left alone; a family that has run is priced by its own rounds."""
    c = costs(batch=4)
    ctl = controller(c, alpha=0.8, batch=4)
    sync, ssd = Plan("sync", 2), Plan("ssd", 2, 8, "thread", threads=(1, 1))
    acc = ctl.acceptance()
    model_draft = ctl.model(sync).parts["draft"]
    ctl.record_verify(sync, 1.5 * verify_s(sync, c))
    ctl.record_draft(sync, 1.4 * model_draft)
    measured = Ema()
    measured.add(predict(sync, c, acc, 4, {"verify": 1.5 * verify_s(sync, c), "draft": 1.4 * model_draft}).round_s,
                 count=8)
    ctl.memory.round_s[sync] = measured
    parts = ctl.model(ssd).parts
    expected = predict(ssd, c, acc, 4, {"verify": 1.5 * parts["verify"], "draft": 1.4 * parts["tree"],
                                         "backup": 1.4 * parts["backup"]}).round_s
    assert ctl.predict(ssd).round_s == pytest.approx(expected)
    assert expected > 1.3 * ctl.model(ssd).round_s
    assert ctl.predict(Plan("plain")).round_s == pytest.approx(ctl.model(Plan("plain")).round_s)
    # an int8 SSD plan: the verify is the same forward, the fp32 draft's forwards are not its own
    ctl8 = Controller(costs(batch=4, int8=(0.01, 0.0003)), ctl.memory, 4, {}, fixed_alpha=0.8)
    int8 = Plan("ssd", 2, 8, "thread", int8=True, threads=(1, 1))
    p8 = ctl8.model(int8).parts
    assert ctl8.predict(int8).round_s == pytest.approx(
        predict(int8, ctl8.costs, acc, 4, {"verify": 1.5 * p8["verify"]}).round_s)
    own = Ema()
    own.add(ctl.model(ssd).round_s, count=8)  # once SSD has run, its own rounds price it
    ctl.memory.round_s[ssd] = own
    other = Plan("ssd", 2, 12, "thread", threads=(1, 1))
    assert ctl.predict(other).round_s == pytest.approx(ctl.model(other).round_s)

    # the other way round: SSD on a thread ran, its verifies and trees slowed beside each other; sync has not run
    ctl = controller(c, alpha=0.8, batch=4)
    ctl.record_verify(ssd, 1.6 * ctl.model(ssd).parts["verify"])
    ctl.record_draft(ssd, 1.6 * ctl.model(ssd).parts["tree"])
    slow = Ema()
    slow.add(1.6 * ctl.model(ssd).round_s, count=8)
    ctl.memory.round_s[ssd] = slow
    assert ctl.predict(sync).round_s == pytest.approx(ctl.model(sync).round_s)


def test_plain_is_not_calibrated_by_compiled_plans_and_its_hand_off_is_measured(monkeypatch):
    """A plain first choice runs transformers' eager loop: a compiled plan measured faster than its model must not make
    plain look faster too (it would be chosen and never measured), and the hand-off records its own step time."""
    ctl = controller(costs(), alpha=0.8)
    sync = Plan("sync", 4)
    fast = Ema()
    fast.add(0.4 * ctl.model(sync).round_s, count=8)
    ctl.memory.round_s[sync] = fast
    assert ctl.predict(Plan("plain")).round_s == pytest.approx(ctl.model(Plan("plain")).round_s)

    from hf_ssd import session
    from hf_ssd.control import controller as ctl_mod

    memory = Memory()
    monkeypatch.setattr(session, "memory_for", lambda key: memory)
    monkeypatch.setattr(ctl_mod.Controller, "decide",
                        lambda self, current=None, horizon=None: ctl_mod.Decision(Plan("plain"), "test: plain is fastest", []))
    p = get_pair("llama")
    p.target.generate(prompt(6, seed=2), assistant_model=p.related, ssd=True, max_new_tokens=10, do_sample=False,
                      pad_token_id=0)
    measured = memory.round_s[Plan("plain")]
    assert measured.n == 8 and 0 < measured.value < 5
    assert memory.tail["plain"].share == 1.0  # its one row made a token at every step

    # two rows, one ending early: the loop keeps it on padding, and the share of row-steps that made tokens says so
    from hf_ssd.control.plain_acceptance import answer_mask

    memory.tail.clear()
    ids, mask = left_pad([prompt(5, seed=11)[0], prompt(8, seed=12)[0]])
    eos = int(plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=10)[0, ids.shape[1] + 2])
    out = p.target.generate(ids, attention_mask=mask, assistant_model=p.related, ssd=True, max_new_tokens=10,
                            do_sample=False, pad_token_id=0, eos_token_id=eos)
    made = answer_mask(out[:, ids.shape[1]:], [eos]).float().mean().item()
    assert made < 1.0 and memory.tail["plain"].share == pytest.approx(made)


def test_our_loops_calls_charge_plain_for_its_tail_before_it_runs(monkeypatch):
    """Answer lengths are the prompts', whatever path made them: a call in our loop whose rows ended apart says what
    transformers' loop would have kept on padding, so plain's first hand-off at a batch is priced with its tail (its
    first hand-offs at batch 4, priced at every row to the end, ran at 0.65-0.95x their price)."""
    from hf_ssd import session
    from hf_ssd.control.memory import PLAIN_TAIL_FORESEEN, record_plain
    from hf_ssd.control.plain_acceptance import answer_mask

    memory = Memory()
    monkeypatch.setattr(session, "memory_for", lambda key: memory)
    p = get_pair("llama")
    ids, mask = left_pad([prompt(5, seed=11)[0], prompt(8, seed=12)[0]])
    eos = int(plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=10)[0, ids.shape[1] + 2])
    out = p.target.generate(ids, attention_mask=mask, assistant_model=p.related, ssd=True, ssd_mode="sync",
                            max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos,
                            return_dict_in_generate=True)
    assert out.ssd_stats["mode"] == "sync" and Plan("plain") not in memory.round_s  # plain never ran
    made = answer_mask(out.sequences[:, ids.shape[1]:], [eos]).float().mean().item()
    assert made < 1.0 and memory.tail[PLAIN_TAIL_FORESEEN].share == pytest.approx(made)
    ctl = Controller(costs(), memory, 2, {}, fixed_alpha=0.8)
    assert ctl.predict(Plan("plain")).tokens_per_round == pytest.approx(2 * made)
    # plain steps in our loop drop the rows that ended, as our other plans do: not charged for padding
    assert ctl.predict(Plan("plain"), in_loop=True).tokens_per_round == pytest.approx(2.0)
    record_plain(memory, 0.1, 9, rows_share=0.9)  # once a hand-off has run, its own measurement prices it
    assert ctl.predict(Plan("plain")).tokens_per_round == pytest.approx(2 * 0.9)


def test_a_compiled_target_calibrates_plain_too():
    """With ssd_compile_target a plain choice runs compiled as well, so a compiled speed-up measured on other plans
    carries over to plain, as to every family that has not run."""
    ctl = Controller(costs(), Memory(), 1, {}, fixed_alpha=0.8, plain_compiled=True)
    sync = Plan("sync", 4)
    fast = Ema()
    fast.add(0.4 * ctl.model(sync).round_s, count=8)
    ctl.memory.round_s[sync] = fast
    assert ctl.predict(Plan("plain")).round_s == pytest.approx(0.4 * ctl.model(Plan("plain")).round_s)


def test_plain_choice_with_a_compiled_target_runs_transformers_compiled_loop(monkeypatch):
    """ssd_compile_target=True and a plain first choice: transformers' loop on a static cache with its decode step
    compiled (the user asked for a compiled target), same tokens as plain generate(), and ssd_stats say so. A call
    that compiled does not price plain (its time is mostly compiling); the next one does."""
    from torch._dynamo.utils import counters

    from hf_ssd import session
    from hf_ssd.control import controller as ctl_mod

    memory = Memory()
    monkeypatch.setattr(session, "memory_for", lambda key: memory)
    monkeypatch.setattr(ctl_mod.Controller, "decide",
                        lambda self, current=None, horizon=None: ctl_mod.Decision(Plan("plain"), "test: plain is fastest", []))
    p = get_pair("llama")
    ids = prompt(6, seed=3)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = p.target.generate(ids, **kw)
    graphs = counters["stats"]["unique_graphs"]
    out = p.target.generate(ids, assistant_model=p.related, ssd=True, ssd_compile_target=True,
                            return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    assert "(static cache, compiled)" in out.ssd_stats["controller"]["reason"]
    assert counters["stats"]["unique_graphs"] > graphs  # the decode step went through torch.compile
    assert Plan("plain") not in memory.round_s
    graphs = counters["stats"]["unique_graphs"]
    again = p.target.generate(ids, assistant_model=p.related, ssd=True, ssd_compile_target=True, **kw)
    assert torch.equal(again, ref) and counters["stats"]["unique_graphs"] == graphs
    assert memory.round_s[Plan("plain")].n == 7  # seconds per decode step (the prefill's token left out)


def test_measuring_the_pair_leaves_the_callers_rng_alone():
    """The cost probe runs forwards on token ids of its own: a seeded generate() draws the same samples whether its
    call measured the pair or found the costs cached."""
    from hf_ssd.control.costs import measure_costs

    p = get_pair("llama")
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    measure_costs(p.target, p.related, batch=1, n_max=4)
    assert torch.equal(torch.rand(3), expected)


def test_rows_the_ngram_backup_served_leave_alpha_alone():
    """α is the draft model's acceptance: an SSD round whose row missed the cache and drafted with the n-gram backup
    (accepting nothing, say) is the mode's yield, not evidence against every drafting plan; the cache's and the
    just-in-time draft's rows count."""
    from types import SimpleNamespace

    from hf_ssd.control.drafter import ControlledDrafter
    from hf_ssd.core.types import SOURCE_CACHE, SOURCE_JIT, SOURCE_NGRAM, Outcome, Speculation, Verdict

    observed = []
    controller = SimpleNamespace(batch=3, record_verify=lambda p, s: None, record_tokens=lambda p, tokens, served: None,
                                 observe_acceptance=lambda accepted, rejected, int8, rows: observed.append(
                                     (accepted, rejected, int8)))
    source = torch.tensor([SOURCE_CACHE, SOURCE_JIT, SOURCE_NGRAM])
    fake = SimpleNamespace(memory=Memory(), controller=controller, plan=Plan("ssd", 3, 8, "thread", int8=True),
                           last_start=None, disturbed=lambda: False, _compiled_lately=lambda: False,
                           spec=Speculation(torch.zeros(3, 3, dtype=torch.long), torch.tensor([3, 3, 3]), None, source))
    verdict = Verdict(Outcome(torch.tensor([3, 1, 0]), torch.tensor([5, 6, 7])), torch.tensor([True] * 3), [], [], 0.0)
    ControlledDrafter._observe(fake, verdict, 0.05)
    assert observed == [(4.0, 1.0, True)]  # rows 0 and 1: 3 + 1 accepted, one rejection, of the int8 draft


def test_measured_tokens_per_round_scale_the_models():
    """An SSD plan whose rounds commit fewer tokens than the acceptance model says (misses served by the n-gram
    backup) is priced by what its rounds committed, and so are the untried SSD plans (any worker); plain then wins."""
    ctl = controller(costs(), alpha=0.8, batch=4)
    ssd = ctl.decide().plan
    assert ssd.mode == "ssd"
    modelled = ctl.model(ssd)
    sibling = next(p for p in ctl.plans if p.mode == "ssd" and p != ssd)
    sibling_modelled = ctl.model(sibling)
    ctl.memory.record_round(ssd, modelled.round_s, count=8)
    for _ in range(200):
        ctl.record_tokens(ssd, 1.05)  # per row: barely more than plain's one token
    ratio = 1.05 / (modelled.tokens_per_round / 4)
    assert ctl.predict(ssd).tokens_per_round == pytest.approx(ratio * modelled.tokens_per_round, rel=0.02)
    assert ctl.predict(sibling).tokens_per_round == pytest.approx(ratio * sibling_modelled.tokens_per_round, rel=0.02)
    sync = Plan("sync", 4)
    assert ctl.predict(sync).tokens_per_round == pytest.approx(ctl.model(sync).tokens_per_round)  # its own mode
    assert ctl.decide().plan.mode != "ssd"


def test_a_plan_measured_on_hard_text_is_priced_at_the_calls_alpha():
    """Tokens per round depend on the text: a plan that ran on a hard stretch (α 0.4) committed few tokens per
    round, and one that ran on code (α 0.95) many. Priced by those raw counts, the first would look slow forever.
    A synchronous round is the acceptance model itself, so a new call prices both at its own α; SSD rounds are
    judged against the model at the α they were drafted at, so the text's difficulty cancels there too."""
    ctl = Controller(costs(draft=(0.05, 0.001)), Memory(), 1, {"mode": ("sync", "ssd")})
    hard, easy = Plan("sync", 3), Plan("ssd", 6, 16, "thread", threads=(1, 1))
    for plan, alpha, accepted in ((hard, 0.4, 0.6), (easy, 0.95, 5.5), (hard, 0.6, 0.5)):
        ctl.fixed_alpha = alpha
        for _ in range(20):
            ctl.record_tokens(plan, 1.0 + accepted)
            ctl.observe_acceptance(accepted, 1.0)
            ctl.memory.record_round(plan, ctl.model(plan).round_s)
    ctl.fixed_alpha = 0.8
    assert ctl.predict(hard).tokens_per_round == pytest.approx(ctl.model(hard).tokens_per_round)
    unmeasured = predict(easy, ctl.costs, ctl.acceptance(), 1).tokens_per_round  # the acceptance model alone
    assert ctl.predict(easy).tokens_per_round == pytest.approx(unmeasured, rel=0.1)
    assert 0.9 < ctl.memory.ssd_yield.ratio < 1.1


def test_decode_clock_leaves_the_prefill_out(monkeypatch):
    """The plain hand-off's clock starts at the prefill's logits: (end - first) / (new tokens - 1) per step."""
    from hf_ssd.hf import plain_hand_off

    clock = plain_hand_off.DecodeClock()
    monkeypatch.setattr(plain_hand_off.time, "perf_counter", lambda: 10.0)
    scores = torch.zeros(1, 5)
    assert clock(None, scores) is scores
    monkeypatch.setattr(plain_hand_off.time, "perf_counter", lambda: 99.0)
    clock(None, scores)
    assert clock.seconds_per_step(13.0, 4) == pytest.approx(1.0)
    assert clock.seconds_per_step(13.0, 1) is None


def test_decode_clock_prices_a_call_that_compiled_by_its_other_steps(monkeypatch):
    """A plain call that compiled transformers' loop: its first decode step took 20 s (the compile), the other
    ten 0.1 s. The step is 0.1 s and the compile 19.9 s (such calls used to price plain not at all)."""
    from hf_ssd.hf import plain_hand_off

    clock = plain_hand_off.DecodeClock()
    now = iter([0.0, 20.0] + [20.0 + 0.1 * i for i in range(1, 11)])
    monkeypatch.setattr(plain_hand_off.time, "perf_counter", lambda: next(now))
    for _ in range(12):
        clock(None, torch.zeros(1, 5))
    assert clock.seconds_per_step(21.05, 12, compiled=True) == pytest.approx(0.1)
    assert clock.compile_s == pytest.approx(19.9)
    assert clock.seconds_per_step(21.05, 12) == pytest.approx(21.05 / 11)  # not compiled: the plain mean
    assert clock.seconds_per_step(21.05, 5, compiled=True) is None  # too few steps to tell a step from a compile


def test_a_compiled_plain_step_is_calibrated_by_the_measured_verifies():
    """With a compiled target, a plain step is one target forward: the verifies the draft plans measured say how
    much faster that runs than its eager cost line, better than whole rounds do (they include the draft's work)."""
    ctl = Controller(costs(), Memory(), 1, {}, fixed_alpha=0.8, plain_compiled=True)
    sync = Plan("sync", 4)
    rounds = Ema()
    rounds.add(0.8 * ctl.model(sync).round_s, count=8)
    ctl.memory.round_s[sync] = rounds
    plain = ctl.model(Plan("plain")).round_s
    assert ctl.predict(Plan("plain")).round_s == pytest.approx(0.8 * plain)
    eager_verify = ctl.model(sync).parts["verify"]  # measured verifies then price the model's (learned_line)
    for _ in range(8):
        ctl.record_verify(sync, 0.5 * eager_verify)
    assert ctl.predict(Plan("plain")).round_s == pytest.approx(0.5 * plain)
    # an eager plain (transformers' own loop) keeps the model's price whatever the verifies measured
    eager = Controller(costs(), ctl.memory, 1, {}, fixed_alpha=0.8)
    assert eager.predict(Plan("plain")).round_s == pytest.approx(plain)


def test_a_switch_to_plain_mid_generation_is_priced_as_our_loop_runs_it():
    """Mid-generation, plain runs as one-token rounds of our loop, not as the transformers loop a call hands off to.
    On a compiled target those steps run its compiled one-token graph: priced at compiled plain's price until they
    are measured, then at least at what they measured (our per-round work included). On an eager target they are
    never priced below the eager cost line."""
    ctl = Controller(costs(), Memory(), 1, {"mode": ("plain", "sync"), "K": (4,)}, fixed_alpha=0.5,
                     plain_compiled=True)
    sync, plain = Plan("sync", 4), Plan("plain")
    ctl.memory.record_round(sync, 0.9 * ctl.model(sync).round_s, tokens=ctl.model(sync).tokens_per_round, count=8)
    eager_verify = ctl.model(sync).parts["verify"]
    for _ in range(8):
        ctl.record_verify(sync, 0.3 * eager_verify)
    assert ctl.predict(plain).tokens_per_s > 1.1 * ctl.predict(sync).tokens_per_s
    assert ctl.decide().plan == plain
    assert ctl.model(plain).tokens_per_s < ctl.predict(sync).tokens_per_s  # the eager line: slower than sync
    assert ctl.predict(plain, in_loop=True).round_s == pytest.approx(ctl.predict(plain).round_s)
    assert ctl.decide(current=sync).plan == plain
    for _ in range(8):  # our loop's plain steps measure as slow as the eager line, twice over
        ctl.memory.in_loop_plain.add(2 * ctl.model(plain).round_s)
    assert ctl.predict(plain, in_loop=True).round_s == pytest.approx(2 * ctl.model(plain).round_s)
    assert ctl.decide(current=sync).plan == sync

    eager = Controller(costs(), Memory(), 1, {"mode": ("plain", "sync"), "K": (4,)}, fixed_alpha=0.5)
    eager.memory.record_round(plain, 0.5 * eager.model(plain).round_s, count=8)  # transformers' loop, measured fast
    assert eager.predict(plain, in_loop=True).round_s == pytest.approx(eager.model(plain).round_s)


def test_a_decisions_shared_work_gives_the_plans_own_predictions():
    """decide() computes the model's predictions and the calibrations once per decision (Controller._shared): its
    table must hold each plan's own prediction, after measurements that move the calibration."""
    c = costs()
    ctl = Controller(c, Memory(), 1, {})
    sync, ssd = Plan("sync", 3), Plan("ssd", 3, 8, "thread", threads=(1, 1))
    ctl.memory.record_round(sync, 0.5 * ctl.model(sync).round_s, tokens=4.0, count=8)  # sync runs twice as fast
    ctl.memory.add_acceptance(90.0, 10.0, rounds=0)
    for _ in range(2):  # and again after more measurements
        table = ctl.decide().table
        assert len(table) > 1
        for pred in table:
            assert pred.tokens_per_s == pytest.approx(ctl.predict(pred.plan, aged=True).tokens_per_s)
        ctl.memory.record_round(ssd, 3.0 * ctl.model(ssd).round_s, tokens=2.0, count=8)
    ctl.model(ssd).parts["tree"] = -1.0  # a caller editing its copy changes no other prediction
    assert ctl.model(ssd).parts["tree"] > 0


def test_decisions_take_a_bounded_share_of_the_rounds():
    """Re-deciding predicts every plan (milliseconds): every DECIDE_EVERY fast rounds, every round when rounds are
    slow (DECIDE_PERIOD_S), and never more than DECIDE_SHARE of the time since the last decision, so fast compiled
    rounds are not spent predicting."""
    from hf_ssd.control.drafter import DECIDE_EVERY, DECIDE_PERIOD_S, DECIDE_SHARE, decision_due

    fast = 0.01  # seconds per round
    assert not decision_due(DECIDE_EVERY - 1, (DECIDE_EVERY - 1) * fast, 0.0)
    assert decision_due(DECIDE_EVERY, DECIDE_EVERY * fast, 0.0)
    assert not decision_due(0, 10.0, 0.0)  # nothing new measured
    assert decision_due(1, DECIDE_PERIOD_S, 0.0)  # one slow round (a 1.5B target on a CPU): decide now
    assert not decision_due(1, 0.9 * DECIDE_PERIOD_S, 0.0)
    decide_s = 0.003
    assert not decision_due(DECIDE_EVERY, 0.9 * decide_s / DECIDE_SHARE, decide_s)  # 8 rounds of 9 ms: too soon
    assert decision_due(DECIDE_EVERY, 1.1 * decide_s / DECIDE_SHARE, decide_s)
    assert not decision_due(1, DECIDE_PERIOD_S, DECIDE_PERIOD_S)  # a decision as slow as the rounds: not yet


def test_no_decision_where_too_little_of_the_call_is_left_for_a_switch():
    """A switch takes CONFIRMATIONS decisions in a row, spaced as the rounds since the last one, and rounds after
    it to repay its restart: with fewer rounds left than that, no decision is made (it would only cost its time)."""
    from types import SimpleNamespace

    from hf_ssd.control.drafter import CONFIRMATIONS, ControlledDrafter

    assert CONFIRMATIONS == 2

    def could_pay(context: int, rounds: int, pending: int, max_length: int | None = 200) -> bool:
        # 2 tokens a round so far, the last decision at round 0
        fake = SimpleNamespace(max_length=max_length, rounds=rounds, decided_at=0, pending=[None] * pending,
                               tokens=2.0 * (rounds - 1))
        verdict = SimpleNamespace(contexts=[torch.zeros(context), torch.zeros(context - 5)])
        return ControlledDrafter._switch_could_pay(fake, verdict)

    # 10 rounds since the last decision: the first of two decisions needs 20 rounds left, i.e. 40 tokens
    assert could_pay(context=160, rounds=10, pending=0)
    assert not could_pay(context=161, rounds=10, pending=0)
    assert could_pay(context=170, rounds=10, pending=1)  # the confirming decision: 10 rounds left suffice
    assert not could_pay(context=182, rounds=10, pending=1)
    assert could_pay(context=199, rounds=10, pending=0, max_length=None)  # the call's length unknown: decide
    assert could_pay(context=199, rounds=1, pending=0)  # nothing measured yet


def test_a_switch_to_uncompiled_shapes_pays_for_their_compiles(monkeypatch):
    """With compiled forwards, a plan whose shapes this process has not compiled builds its graphs when it starts
    (seconds each). A setting's first COMPILE_FREE_CALLS calls compile whatever they choose (the warm-up the user
    opted into); after that a switch pays its compiles out of the call, spread over the call and as many tokens
    again as the setting has generated: a short call keeps the compiled plan, and a long-running setting compiles
    the faster one."""
    from hf_ssd.control import compiled as compiled_mod
    from hf_ssd.control.compiled import PLAIN_LOOP_PRIOR_GRAPHS, record_plain_loop_compile
    from hf_ssd.control.decision import Horizon
    from hf_ssd.runtime import static_registry

    monkeypatch.setattr(compiled_mod, "_PLAIN_LOOP_S", {})
    monkeypatch.setattr(static_registry, "COMPILE_SPENT", {"seconds": 30.0, "graphs": 10})  # 3 s per graph
    allowed = {"mode": ("sync",), "K": (1, 4)}
    one, four = Plan("sync", 1), Plan("sync", 4)
    for compiled in (False, True):
        ctl = Controller(costs(), Memory(), 1, allowed, fixed_alpha=0.9, plain_compiled=compiled,
                         draft_compiled=compiled, target=torch.nn.Linear(1, 1))
        horizon = Horizon(tokens=64, context=100)
        assert ctl.decide(horizon=horizon).plan == four  # nothing compiled yet: the best plan, no compile priced
        ctl.mark_compiled(one)  # ... but say sync K=1 ran first
        assert ctl.decide(one, horizon).plan == four  # the warm-up calls compile whatever they choose
        ctl.memory.calls, ctl.memory.exploring_calls = COMPILE_FREE_CALLS, 2
        assert ctl.decide(one, horizon).plan == four  # two of them explored: those do not count, still free
        ctl.memory.exploring_calls = 0
        decision = ctl.decide(one, horizon)
        if not compiled:
            assert decision.plan == four  # eager forwards: nothing to compile, the faster plan
            continue
        assert decision.plan == one  # 3 s of compiles (its verify width 5) for a 64-token call: keep K=1
        priced = next(p for p in decision.table if p.plan == four)
        assert priced.parts["compile"] == pytest.approx(3.0)  # one graph (verify 5 wide; draft widths 1, 2 built)
        # the call's record says what the decision ranked by: the speed over the call, with the compiling in it
        row = next(r for r in drafter_mod.call_record(ctl, decision)["predicted"] if r["plan"] == four.label)
        assert row["compile_s"] == pytest.approx(3.0) and row["call_tok_s"] < row["tok_s"]
        assert row["parts"]["verify"] == pytest.approx(priced.parts["verify"], abs=1e-5)  # and what it priced from
        assert row["parts"]["draft"] > 0 and "compile" not in row["parts"]
        # transformers' compiled plain loop: a few of ours until a hand-off measured it
        assert ctl.compile_s(Plan("plain"), horizon, in_loop=False) == pytest.approx(3.0 * PLAIN_LOOP_PRIOR_GRAPHS)
        record_plain_loop_compile(ctl.target, 21.0)
        assert ctl.compile_s(Plan("plain"), horizon, in_loop=False) == pytest.approx(21.0)
        # plain steps in our loop run the target's one-token graph: one of ours
        assert ctl.compile_s(Plan("plain"), horizon, in_loop=True) == pytest.approx(3.0)
        # built already in this process (the caller's own compiled generate(), or a bench row's warm-up): free
        ctl.target._compiled_call = torch.compile(ctl.target.__call__)
        assert ctl.compile_s(Plan("plain"), horizon, in_loop=False) == 0.0
        del ctl.target._compiled_call
        ctl.memory.generated = 1e6  # a long-running setting: the compile pays over its future
        assert ctl.decide(one, horizon).plan == four
        ctl.mark_compiled(four)
        assert "compile" not in next(p for p in ctl.decide(one, horizon).table if p.plan == four).parts


def test_graphs_built_on_caches_for_short_prompts_are_built_again_for_a_long_one(monkeypatch):
    """Our graphs are built per static cache, sized by the call's length limit and the plan's tree: a plan that ran
    on short prompts has no graphs for a call whose cache must be larger, and the controller prices their compiles
    (a larger cache serves a shorter call, up to REUSE_LARGER times the slots it needs)."""
    from hf_ssd.control.compiled import built, plan_graphs
    from hf_ssd.control.decision import Horizon
    from hf_ssd.runtime import static_registry

    ssd = Plan("ssd", 4, 8, "process")
    short = plan_graphs(ssd, True, True, max_length=200)  # 242 slots: a cache of MIN_SLOTS (1024)
    assert all(built(g, set(short)) for g in plan_graphs(ssd, True, True, max_length=900))  # the same cache size
    long = plan_graphs(ssd, True, True, max_length=1300)  # 1342 slots: a cache of 2048
    assert not any(built(g, set(short)) for g in long)
    assert all(built(g, set(long)) for g in short)  # the registry lends the larger cache to a shorter call
    huge = plan_graphs(ssd, True, True, max_length=4500)  # a cache of 8192: more than 4x what a 200-token call needs
    assert not any(built(g, set(huge)) for g in short)

    def controller_for(max_length):
        return Controller(costs(), memory, 1, {"mode": ("ssd",), "K": (4,), "budget": 8}, fixed_alpha=0.9,
                          plain_compiled=True, draft_compiled=True, max_length=max_length)

    memory = Memory(calls=COMPILE_FREE_CALLS)  # past the warm-up calls
    controller_for(200).mark_compiled(ssd)
    monkeypatch.setattr(static_registry, "COMPILE_SPENT", {"seconds": 30.0, "graphs": 10})  # 3 s per graph
    horizon = Horizon(tokens=64, context=100)
    assert controller_for(900).compile_s(ssd, horizon, in_loop=False) == 0.0
    assert controller_for(1300).compile_s(ssd, horizon, in_loop=False) == pytest.approx(3.0 * len(long))


def test_the_graphs_each_plan_compiles():
    """control.compiled.plan_graphs: a verify width per K (compiled target); draft widths per K and budget, kept
    apart for a process worker and an int8 draft (their graphs live elsewhere); plain's compiled loop when handed
    off, the target's one-token width in our loop."""
    from hf_ssd.control.compiled import plan_graphs

    ssd = Plan("ssd", 3, 8, "thread")
    assert plan_graphs(ssd, draft=False, target=False) == frozenset()
    assert plan_graphs(ssd, draft=False, target=True) == {("target", 4)}
    assert plan_graphs(ssd, draft=True, target=False) == {("draft", False, False, w) for w in (1, 4, 8, 9)}
    process = plan_graphs(Plan("ssd", 3, 8, "process"), draft=True, target=False)
    int8 = plan_graphs(Plan("ssd", 3, 8, "thread", int8=True), draft=True, target=False)
    assert not process & plan_graphs(ssd, True, False) and not int8 & plan_graphs(ssd, True, False)
    assert plan_graphs(Plan("sync", 5), draft=True, target=True) == {("target", 6), ("draft", False, False, 1),
                                                                    ("draft", False, False, 2)}
    assert plan_graphs(Plan("plain"), draft=True, target=True) == {("plain",)}
    assert plan_graphs(Plan("plain"), draft=True, target=True, in_loop=True) == {("target", 1)}  # our loop's step


def test_plain_on_an_unmeasured_alpha_is_explored_and_then_left_alone():
    """Plain decoding observes no acceptance, so a plain choice on the prior α would stand forever. Until α rests on
    EXPLORE_ROUNDS drafting rounds, a call that would start plain runs the best drafting plan if it is predicted
    within EXPLORE_WITHIN of plain; not once α is measured, nor where drafting is predicted far slower, nor with a
    fixed α."""
    from hf_ssd.control.exploration import EXPLORE_ROUNDS

    c = costs(draft=(0.08, 0.0005), split=2.0)  # at α = 0.7 plain 9.8 tok/s, sync K=1 9.2: plain is the pick
    memory = Memory()
    ctl = Controller(c, memory, 1, {}, prior=Acceptance(alpha=0.7))
    first = ctl.decide()
    assert first.plan.mode == "sync" and first.reason.startswith("exploring sync")
    for _ in range(EXPLORE_ROUNDS):
        ctl.observe_acceptance(0.7, 0.3)  # α = 0.7 measured: plain really is faster
    assert ctl.decide().plan == Plan("plain")
    assert controller(c, alpha=0.7).decide().plan == Plan("plain")  # a fixed α is known: no exploring
    useless = Controller(costs(draft=(0.3, 0.002), split=2.0), Memory(), 1, {}, prior=Acceptance(alpha=0.7))
    assert useless.decide().plan == Plan("plain")


def test_each_drafting_row_of_a_batch_counts_towards_alpha_rests_on():
    """A batch's rows are different prompts: a round of 16 drafting rows counts as 16 towards EXPLORE_ROUNDS (a
    batch-16 setting explored a slow drafting plan in a timed call with α resting on 160 rows' drafts). A round in
    which nothing drafted counts nothing."""
    from hf_ssd.control.exploration import EXPLORE_ROUNDS

    ctl = Controller(costs(batch=16), Memory(), 16, {})
    ctl.observe_acceptance(0.0, 0.0, rows=16)
    assert ctl.memory.alpha_rounds == 0
    for _ in range(EXPLORE_ROUNDS // 16):
        ctl.observe_acceptance(11.0, 5.0, rows=16)
    assert ctl.memory.alpha_rounds == EXPLORE_ROUNDS


def test_a_switch_to_plain_waits_for_rounds_that_rule_drafting_out(monkeypatch):
    """Mid-call, plain must win even at the optimistic end of the call's α (SWITCH_OPTIMISM posterior deviations):
    a switch to plain lasts the rest of the call, and a few unlucky rounds are not evidence enough. A long bad stretch
    is."""
    from hf_ssd.control import controller as ctl_mod

    c = costs(draft=(0.07, 0.0005), split=2.0)  # sync K=1 wins at α = 0.8, plain at 0.7
    memory = Memory()
    memory.add_acceptance(80.0, 20.0, rounds=100, rows=100)  # earlier calls
    running = Plan("sync", 1)
    ctl = Controller(c, memory, 1, {}, prior=Acceptance(alpha=0.7))
    assert ctl.decide().plan == running
    ctl.observe_acceptance(0.0, 5.0)  # five rounds, all rejected
    kept = ctl.decide(current=running)
    assert kept.plan == running and kept.reason.startswith("keeping sync K=1: plain is predicted faster")
    monkeypatch.setattr(ctl_mod, "SWITCH_OPTIMISM", 0.0)
    assert ctl.decide(current=running).plan == Plan("plain")  # at the call's α alone it would have switched
    monkeypatch.undo()
    for _ in range(20):
        ctl.observe_acceptance(0.4, 0.6)  # twenty more rounds at α = 0.4
    assert ctl.decide(current=running).plan == Plan("plain")


def test_plain_steps_in_our_loop_are_priced_by_what_they_measured():
    """A switch to plain mid-call runs one-token rounds of our loop. Once such rounds have run, their measured time
    prices the next switch (at batch 16 on the overhead workload they decoded at ~510 tok/s where the hand-off's
    price said ~620, and staying on synchronous K = 1 made ~660)."""
    from hf_ssd.control.memory import Ema

    c = costs(draft=(0.07, 0.0005), split=2.0)
    ctl = controller(c, alpha=0.6)
    running = Plan("sync", 1)
    ctl.memory.round_s[running] = fast = Ema()
    fast.add(0.9 * ctl.predict(Plan("plain"), in_loop=True).round_s * ctl.model(running).tokens_per_round,
             count=8)  # sync K = 1 measured a little faster per token than plain's price
    hand_off = ctl.predict(Plan("plain"), in_loop=True).round_s
    assert ctl.decide(current=running).plan == running
    ctl.memory.round_s[running] = slow = Ema()
    slow.add(1.6 * hand_off * ctl.model(running).tokens_per_round, count=8)  # now clearly slower: plain wins
    assert ctl.decide(current=running).plan == Plan("plain")
    ctl.memory.in_loop_plain.add(2.0 * hand_off, count=8)  # ... until plain steps in our loop have been measured
    assert ctl.predict(Plan("plain"), in_loop=True).round_s == pytest.approx(2.0 * hand_off)
    assert ctl.predict(Plan("plain")).round_s == pytest.approx(hand_off)  # a call's start hands off: unchanged
    assert ctl.decide(current=running).plan == running


def test_calls_with_constraining_options_learn_apart_from_free_ones(monkeypatch):
    """A call whose options fix part of the plan (a benchmark's hand-picked row) does not teach `ssd=True` alone: a
    user's free calls start from what their own calls measured."""
    from hf_ssd.control import memory as memory_mod

    monkeypatch.setattr(memory_mod, "_MEMORY", {})
    pair = get_pair("llama")
    ids, mask = left_pad([prompt(7, seed=5)[0]])
    kw = dict(attention_mask=mask, assistant_model=pair.related, ssd=True, max_new_tokens=12, do_sample=False,
              pad_token_id=0)
    pair.target.generate(ids, ssd_mode="ssd", ssd_worker="inline", **kw)
    assert len(memory_mod._MEMORY) == 1
    pair.target.generate(ids, **kw)
    assert len(memory_mod._MEMORY) == 2
    pair.target.generate(ids, **kw)
    assert len(memory_mod._MEMORY) == 2


def test_a_budget_is_priced_by_its_own_misses_and_what_its_missed_rows_committed():
    """The cache of a narrow budget missed far more than the fitted guessability said, and the rows a backup served
    after a miss committed half what the cache's rows did. Its measured misses price it (and, scaled alike, the
    budgets that have not run), and the miss yield prices every budget by its own hit rate: the wider budget,
    predicted to miss less, is priced above it, where one pooled yield priced both alike."""
    from hf_ssd.control.drafter import served_rows
    from hf_ssd.control.plan import modelled_hit_rate
    from hf_ssd.core.speed_model import expected_tokens_per_round

    ctl = controller(costs(), 0.7, {"mode": ("ssd",), "K": (2,)})
    narrow, wide = Plan("ssd", 2, 3, "thread"), Plan("ssd", 2, 12, "thread")
    e = expected_tokens_per_round(0.7, 2)
    p_narrow, p_wide = (modelled_hit_rate(p, ctl.acceptance()) for p in (narrow, wide))
    measured_hit = p_narrow - 0.25
    rng = random.Random(0)
    for _ in range(400):
        hit = rng.random() < measured_hit
        source = [0 if hit else 1]  # SOURCE_CACHE / SOURCE_JIT
        accepted = [round(e - 1) if hit else 0]
        ctl.record_tokens(narrow, float(accepted[0] + 1), served_rows(source, accepted))
        ctl.record_lookups(narrow, float(hit), 1)
    narrow_pred, wide_pred = ctl.predict(narrow), ctl.predict(wide)
    assert narrow_pred.p_hit == pytest.approx(measured_hit, abs=0.06)
    # the wide budget's modelled misses, scaled by the narrow one's measured / modelled misses
    assert wide_pred.p_hit == pytest.approx(1 - (1 - p_wide) * (1 - measured_hit) / (1 - p_narrow), abs=0.06)
    served = ctl.served(narrow)
    assert served.miss_yield < 0.6 * served.hit_yield
    per_round = lambda pred: pred.tokens_per_round  # noqa: E731
    assert per_round(wide_pred) > 1.1 * per_round(narrow_pred)
    # a row served from the cache or by a backup is told apart; a synchronous speculation does not say
    assert served_rows([0, 2, 0], [3, 0, 1]) == ((2, 6.0), (1, 1.0))
    assert served_rows(None, [3]) is None


def test_the_guessability_is_refitted_every_few_rounds_not_every_round(monkeypatch):
    """A fit per round cost a twentieth of a compiled SSD round: the fit is redone once REFIT_ROUNDS rounds came in
    since the last one (or at the first read after the first round)."""
    from hf_ssd.control.memory import REFIT_ROUNDS, Guessability

    g = Guessability()
    assert g.fit is None
    fits = []
    fit = g.estimator.fit
    monkeypatch.setattr(g.estimator, "fit", lambda: fits.append(1) or fit())
    counts = lambda *head: [*head] + [0.0] * (g.estimator.fmax + 1 - len(head))  # noqa: E731
    g.add(counts(3.0, 1.0, 1.0))
    first = g.fit
    assert first is not None and len(fits) == 1
    for _ in range(REFIT_ROUNDS - 1):
        g.add(counts(0.0, 4.0, 1.0, 1.0))
        assert g.fit == first
    g.add(counts(0.0, 4.0, 1.0, 1.0))
    assert g.fit != first and len(fits) == 2


def test_an_aged_compiled_plain_price_follows_the_verifies_drift_not_their_model():
    """With a compiled target, plain not yet measured is priced by the verifies' measured ratio. Once measured
    (transformers' compiled loop, here 1.5x what that ratio says), its aged price moves only as the verifies' ratio
    has moved since: old, it is not re-checked on the verify model's word, and a machine now 20% faster is."""
    from hf_ssd.control.calibration import STALE_HALF_LIFE
    from hf_ssd.control.memory import record_plain

    ctl = Controller(costs(), Memory(), 1, {"mode": ("plain", "sync"), "K": (2,)}, fixed_alpha=0.5,
                     plain_compiled=True)
    plain, sync = Plan("plain"), Plan("sync", 2)
    for _ in range(8):
        ctl.memory.verify.add(0.5)
    modelled = 0.5 * ctl.model(plain).round_s
    assert ctl.predict(plain).round_s == pytest.approx(modelled)
    record_plain(ctl.memory, 1.5 * modelled, steps=8)
    ctl.memory.record_round(sync, ctl.model(sync).round_s, count=8, rounds=3 * STALE_HALF_LIFE)  # plain ages
    assert ctl.predict(plain, aged=True).round_s == pytest.approx(1.5 * modelled, rel=1e-6)
    for _ in range(30):  # the verifies now run 20% faster: so, likely, does plain
        ctl.memory.verify.add(0.4)
    aged = ctl.predict(plain, aged=True).round_s
    assert 0.8 * 1.5 * modelled < aged < 0.85 * 1.5 * modelled


def test_the_untried_k_next_to_the_measured_choice_gets_one_look():
    """Eager cost lines can be off on one more draft step by 2x, and an untried K priced a little below the
    measured choice would never run: the K next to the choice's, predicted within NEIGHBOUR_LOOK_WITHIN of it, gets
    one call (its rounds then price it), the other side's next, and neither again; plans further off get none."""
    from hf_ssd.control.exploration import NEIGHBOUR_LOOK_WITHIN

    ctl = controller(costs(), alpha=0.8, allowed={"mode": ("sync",)})
    best = ctl.decide().plan
    _measured_as_modelled(ctl, best)
    ctl.memory.end_call()
    speed = {p.K: ctl.predict(p).tokens_per_s for p in ctl.plans}
    near = sorted((k for k in (best.K - 1, best.K + 1) if speed.get(k, 0) >= NEIGHBOUR_LOOK_WITHIN * speed[best.K]),
                  key=lambda k: -speed[k])
    assert near, speed  # the test needs a neighbour in reach
    looked = []
    for _ in range(len(near) + 1):
        decision = ctl.decide()
        assert decision.chosen == best  # a look runs a plan; the choice stays the measured one
        if decision.plan == best:
            break
        assert decision.reason.startswith(f"a look at sync K={decision.plan.K}")
        looked.append(decision.plan.K)
        _measured_as_modelled(ctl, decision.plan)  # the model was right: the choice stays the fastest
        ctl.memory.end_call()
    assert looked == near
    assert ctl.decide().plan == best


def test_a_neighbour_that_measures_faster_becomes_the_choice_and_the_climb_goes_on():
    ctl = controller(costs(), alpha=0.8, allowed={"mode": ("sync",)})
    best = ctl.decide().plan
    _measured_as_modelled(ctl, best)
    ctl.memory.end_call()
    look = ctl.decide().plan
    assert look.K in (best.K - 1, best.K + 1)
    ctl.memory.record_round(look, ctl.model(look).round_s * 0.7, count=8)  # the lines overpriced it
    ctl.memory.end_call()
    nxt = ctl.decide()
    assert nxt.chosen == look
    step = look.K - best.K
    if nxt.plan != look:  # the next K along the climb, where it is in reach
        assert nxt.plan.K == look.K + step and nxt.reason.startswith("a look at")
