"""A draft plan pays its drafter's start (the draft's prefill) once per call, and a switch pays it again: the
controller prices it over the tokens the call has left, and the prefills run on every thread the caller gave."""
from __future__ import annotations

import threading

import pytest
import torch

from hf_ssd.control.controller import Controller
from hf_ssd.control.decision import Horizon
from hf_ssd.control.memory import CallLength, Memory
from hf_ssd.control.costs import Costs, Curve
from hf_ssd.control.plan import Plan
from hf_ssd.testing import get_pair, left_pad, plain_generate, prompt

BATCH = 16


def costs() -> Costs:
    """A verify of (0.10 s + 2 ms/token), a draft step of (20 ms + 0.5 ms/token): drafting pays per round."""
    t, d = Curve.straight(0.10, 0.002), Curve.straight(0.02, 0.0005)
    return Costs(BATCH, t, d, t, d, (1, 1))


def controller(memory: Memory | None = None) -> Controller:
    return Controller(costs(), memory or Memory(), BATCH, {}, fixed_alpha=0.8)


def test_a_long_prompt_and_few_new_tokens_make_plain_the_fastest_call():
    ctl = controller()
    per_round = ctl.decide()
    assert per_round.plan.mode != "plain"  # per round, drafting wins at alpha 0.8
    short = ctl.decide(horizon=Horizon(tokens=16, context=2000))  # the draft's prefill: ~1 s; plain's call: ~1.6 s
    assert short.plan.mode == "plain"
    assert "over this call with its prefill" in short.reason
    long_ = ctl.decide(horizon=Horizon(tokens=512, context=2000))
    assert long_.plan.mode != "plain"
    assert "over this call with its prefills" in long_.reason


def test_the_running_plan_pays_no_start_and_a_switch_does():
    ctl = controller()
    running = ctl.decide().plan  # the fastest per round: first in the table
    table = ctl.decide(current=running, horizon=Horizon(tokens=64, context=500)).table
    assert [p.startup_s for p in table if p.plan == running] == [0.0]
    others = [p for p in table if p.plan != running and p.plan.mode != "plain"]
    assert others and all(p.startup_s > 0 for p in others)
    assert all(p.startup_s == 0 for p in table if p.plan.mode == "plain")


def test_a_switch_is_not_worth_its_restart_near_the_end():
    """Another plan faster per round, but the call has 4 tokens left: the restart's prefill outweighs it. (A
    synchronous plan with another K would not restart: control.controller.retunable.)"""
    ctl = controller()
    small = Plan("ssd", 1, 2, "thread", threads=(1, 1))
    assert ctl.decide(current=small).plan != small  # without a horizon it would switch
    assert ctl.decide(current=small, horizon=Horizon(tokens=4, context=2000)).plan == small
    assert ctl.decide(current=Plan("sync", 1), horizon=Horizon(tokens=4, context=2000)).plan != Plan("sync", 1)


def test_measured_starts_calibrate_the_price():
    ctl = controller()
    plan = Plan("sync", 3)
    modelled = ctl.startup_s(plan, 800)
    assert modelled == pytest.approx(ctl.startup_model(plan, 800))
    for _ in range(4):
        ctl.record_startup(plan, 800, 3 * modelled)
    assert ctl.startup_s(plan, 800) == pytest.approx(3 * modelled)
    assert ctl.startup_s(Plan("plain"), 800) == 0


def test_a_cold_start_does_not_price_the_family():
    """A family's first start, and later one-off starts far above its average, are left out: a fresh draft
    process's first prefill took 197x the model on the overhead workload, and priced at that, every later call ran
    plain decoding, where no drafting plan would start again to correct the price."""
    ctl = controller()
    plan = Plan("sync", 3)
    modelled = ctl.startup_model(plan, 800)
    calls = Horizon(tokens=64, context=800)
    ctl.record_startup(plan, 800, 200 * modelled)  # the first: cold
    assert ctl.startup_s(plan, 800) == pytest.approx(modelled)  # as if none were measured
    assert ctl.decide(horizon=calls).plan.mode != "plain"
    for _ in range(3):
        ctl.record_startup(plan, 800, 2 * modelled)
    assert ctl.startup_s(plan, 800) == pytest.approx(2 * modelled)
    ctl.record_startup(plan, 800, 200 * modelled)  # a restarted process's first prefill, say
    assert ctl.startup_s(plan, 800) == pytest.approx(2 * modelled)
    assert ctl.decide(horizon=calls).plan.mode != "plain"
    for _ in range(3):  # ... but starts that stay slow are the family's price
        ctl.record_startup(plan, 800, 200 * modelled)
    assert ctl.startup_s(plan, 800) > 20 * modelled
    assert ctl.decide(horizon=calls).plan.mode == "plain"


def test_prefills_run_on_every_thread_and_rounds_on_the_plans_split(monkeypatch):
    """A thread-worker plan splits the cores (1+1) for its rounds; the prompt's prefills (the target's, then the
    draft's, in the worker thread) run alone and get both threads. Output: plain generate()'s."""
    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.runtime import kv as kv_mod

    plan = Plan("ssd", 2, 4, "thread", threads=(1, 1))
    monkeypatch.setattr(ctl_mod.Controller, "decide",
                        lambda self, current=None, horizon=None: ctl_mod.Decision(plan, "test: split plan", []))
    seen: list[tuple[bool, bool, int]] = []  # (prefill, main thread, threads)
    forward = kv_mod.CachedModel.forward

    def recording(self, *args, prefill=False, **kwargs):
        seen.append((prefill, threading.current_thread() is threading.main_thread(), torch.get_num_threads()))
        return forward(self, *args, prefill=prefill, **kwargs)

    monkeypatch.setattr(kv_mod.CachedModel, "forward", recording)
    pair = get_pair("llama")
    ids, mask = left_pad([prompt(9, seed=21)[0], prompt(5, seed=22)[0]])
    ref = plain_generate(pair.target, ids, attention_mask=mask, max_new_tokens=20)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = pair.target.generate(ids, attention_mask=mask, assistant_model=pair.related, ssd=True,
                                   max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert torch.get_num_threads() == 2  # the caller's setting comes back
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, ref)
    prefills = [(main, n) for prefill, main, n in seen if prefill]
    assert {main for main, _ in prefills} == {True, False}  # the target's here, the draft's in the worker
    assert all(n == 2 for _, n in prefills)
    rounds = [n for prefill, main, n in seen if main and not prefill]
    assert rounds and all(n == 1 for n in rounds)


def test_call_lengths_are_a_censored_mean_and_limit_hits_say_nothing_alone():
    """Calls that hit their limit are counted at it but do not end a length; until one call ends on its own the
    limit stands (a warm-up of 12 tokens says nothing of the answer's length)."""
    length = CallLength()
    assert length.left(320) == 320
    length.add(4, ended=False)
    length.add(12, ended=False)
    assert length.left(320) == 320
    length.add(91, ended=True)
    expected = (0.9 * (0.9 * 4 + 12) + 91) / 1.0
    assert length.left(320) == round(expected)
    assert length.left(50) == 50  # never past the limit
    for _ in range(40):
        length.add(20, ended=True)
    assert length.left(320) == 20  # the last calls dominate


def test_a_generous_limit_is_priced_at_the_lengths_calls_really_run():
    """max_new_tokens=512 for answers that end after 16 tokens: the draft's prefill is spread over 16, not 512, and
    plain decoding wins the call, as when the limit itself is 16."""
    memory = Memory()
    ctl = controller(memory)
    assert ctl.decide(horizon=ctl.horizon(512, 2000)).plan.mode != "plain"
    for _ in range(3):
        memory.call_length.add(16, ended=True)
    assert ctl.horizon(512, 2000) == Horizon(tokens=16, context=2000)
    assert ctl.decide(horizon=ctl.horizon(512, 2000)).plan.mode == "plain"


def test_generate_records_how_long_each_call_ran(monkeypatch):
    from hf_ssd import session

    memory = Memory()
    monkeypatch.setattr(session, "memory_for", lambda key: memory)
    pair = get_pair("llama")
    ids = prompt(6, seed=3)
    ref = plain_generate(pair.target, ids, max_new_tokens=10)
    kw = dict(assistant_model=pair.related, ssd=True, do_sample=False, pad_token_id=0)
    out = pair.target.generate(ids, max_new_tokens=10, **kw)
    assert torch.equal(out, ref)
    assert (memory.call_length.tokens, memory.call_length.ended) == (10, 0)  # hit its limit: no length yet
    eos = int(ref[0, ids.shape[1] + 3])
    made = next(i for i, t in enumerate(ref[0, ids.shape[1]:].tolist()) if t == eos) + 1
    out = pair.target.generate(ids, max_new_tokens=10, eos_token_id=eos, **kw)
    assert out.shape[1] - ids.shape[1] == made
    assert memory.call_length.tokens == pytest.approx(0.9 * 10 + made)
    assert memory.call_length.ended == pytest.approx(1.0)


def test_a_synchronous_plan_s_start_does_not_grow_with_K():
    """A synchronous plan's first K drafts are its first round's, priced in its rounds: its start is the draft's
    prefill whatever K. (Priced at eager draft steps, K = 8 paid a call's 25 ms more than K = 2 on the overhead
    workload, and `ssd=True` ran K = 2 at α = 1.) An SSD plan's first speculation is drafted before the first verify,
    with nothing to hide under: it grows with K."""
    ctl = controller()
    assert ctl.startup_model(Plan("sync", 8), 500) == ctl.startup_model(Plan("sync", 2), 500) > 0
    assert ctl.startup_model(Plan("ssd", 8, 4, "thread"), 500) > ctl.startup_model(Plan("ssd", 2, 4, "thread"), 500)
    assert ctl.startup_s(Plan("sync", 8), 500) == ctl.startup_s(Plan("sync", 1), 500)  # calibrated too


def test_a_compiled_ssd_plan_s_first_speculation_is_priced_at_its_compiled_steps():
    """With a compiled draft whose trees have run, an SSD plan's first K drafts are priced as its JIT backup (K
    compiled one-token steps), not K eager steps: still growing with K, no longer by the eager step's cost."""
    from hf_ssd.control.tree_cost import TreeCost

    ctl = Controller(costs(), Memory(), BATCH, {}, fixed_alpha=0.8, draft_compiled=True)
    k8, k2 = Plan("ssd", 8, 4, "thread"), Plan("ssd", 2, 4, "thread")
    eager = ctl.startup_model(k8, 500)
    prefill = ctl.startup_model(Plan("sync", 8), 500)
    assert eager == pytest.approx(prefill + 8 * ctl.costs.draft(False, False)(1))  # nothing compiled ran yet
    trees = TreeCost()  # K = 2 trees of 4 branches: forwards of 3, 4 and 5 tokens per row, ~1 ms each
    for _ in range(3):
        trees.add(0.0045, {3: (0.001, 1), 4: (0.001, 1), 1: (0.0009, 1)})
    ctl.memory.lines[("tree", "ssd:thread", False)] = trees
    compiled = ctl.startup_model(k8, 500)
    assert compiled == pytest.approx(prefill + ctl.model(k8).parts["backup"])
    assert prefill < ctl.startup_model(k2, 500) < compiled < eager


def test_a_call_s_start_prices_the_target_prefill_of_its_path():
    """Plain decoding prefills in transformers' loop, a draft plan in ours, which prefills rows of similar length
    together (runtime.prefill). At a call's start the plans on the dearer path pay what it costs beyond the cheaper
    one, as measured per prompt column; while only one path has run, the other is estimated from the call's
    padding; nothing mid-call (the target has prefilled already)."""
    from hf_ssd.control.memory import record_prefill

    ctl = controller()
    start = Horizon(tokens=64, context=500)
    plans = [Plan("plain"), Plan("sync", 3), Plan("ssd", 3, 4, "thread", threads=(1, 1))]

    def prefills(current=None, horizon=start):
        preds = [ctl.predict(plan) for plan in plans]
        for pred in preds:
            ctl._price_call(pred, horizon, current)
        return preds

    assert [p.parts["prefill"] for p in prefills()] == [0.0] * 3  # nothing measured, no padding
    # nothing measured, a padded batch: plain's padded prefill from the target's cost line, the grouped one a share
    padded = Horizon(tokens=64, context=500, prefill_share=0.4)
    assert [p.parts["prefill"] for p in prefills(horizon=padded)] == pytest.approx(
        [0.6 * ctl.costs.target(False)(500), 0.0, 0.0])
    before = [p.call_tokens_per_s for p in prefills()]
    for _ in range(3):
        record_prefill(ctl.memory, "plain", 0.4, 200)
    assert [p.parts["prefill"] for p in prefills()] == [0.0] * 3  # one path, a batch without padding: the same
    # one path measured, a padded batch that our loop prefills in 40% of the tokens: the other path scaled by that
    assert [p.parts["prefill"] for p in prefills(horizon=padded)] == pytest.approx([0.6, 0.0, 0.0])
    for _ in range(3):
        record_prefill(ctl.memory, "engine", 0.2, 200)
    priced = prefills()
    assert [p.parts["prefill"] for p in priced] == pytest.approx([0.5, 0.0, 0.0])
    assert priced[0].call_tokens_per_s < before[0] and [p.call_tokens_per_s for p in priced[1:]] == before[1:]
    plain = prefills(horizon=Horizon(tokens=16, context=2000))[0]
    assert plain.startup_s == pytest.approx(2.0)
    assert "over this call with its prefill (2.0 s)" in ctl.explain(plain, [plain])
    assert [p.parts.get("prefill") for p in prefills(current=Plan("sync", 4))] == [None] * 3


@pytest.mark.parametrize("plain", [False, True], ids=["our loop", "plain hand-off"])
def test_generate_records_the_target_prefill_of_the_path_it_ran(monkeypatch, plain):
    from hf_ssd import session
    from hf_ssd.control import controller as ctl_mod

    memory = Memory()
    monkeypatch.setattr(session, "memory_for", lambda key: memory)
    chosen = Plan("plain") if plain else Plan("sync", 3)
    monkeypatch.setattr(ctl_mod.Controller, "decide",
                        lambda self, current=None, horizon=None: ctl_mod.Decision(chosen, "test", []))
    p = get_pair("llama")
    ids, mask = left_pad([prompt(9, seed=11)[0], prompt(4, seed=12)[0]])
    out = p.target.generate(ids, attention_mask=mask, assistant_model=p.related, ssd=True, max_new_tokens=6,
                            do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    path = "plain" if plain else "engine"
    assert list(memory.prefill) == [path] and 0 < memory.prefill[path].value < 1
    assert (out.ssd_stats["target_prefill_s"] is None) == plain


def test_a_call_s_horizon_carries_its_grouped_prefill_share(monkeypatch):
    """generate() hands the controller the share of the padded prefill our loop would run (runtime.prefill): 1
    for a single row, less for a batch of prompts of very different lengths."""
    from hf_ssd import session
    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.runtime.prefill import grouped_share

    seen = []
    monkeypatch.setattr(session, "memory_for", lambda key: Memory())
    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None: (
        seen.append(horizon) or ctl_mod.Decision(Plan("sync", 2), "test", [])))
    p = get_pair("llama")
    ids, mask = left_pad([prompt(300, seed=11)[0], prompt(4, seed=12)[0], prompt(5, seed=13)[0]])
    p.target.generate(ids, attention_mask=mask, assistant_model=p.related, ssd=True, max_new_tokens=3,
                      do_sample=False, pad_token_id=0)
    share = grouped_share(mask[:, :-1].bool(), 64)
    assert share < 0.5 and seen[0].prefill_share == pytest.approx(share)
    assert grouped_share(torch.ones(1, 20, dtype=torch.bool), 64) == 1.0


def test_our_prefill_is_priced_per_padded_column_whatever_padding_measured_it():
    """Our loop's prefill is recorded per column of the padded batch it stands for (its seconds over the width
    times the call's share), so a price measured on batches of similar prompts still sees what grouping saves on a
    batch of one long and three short ones, and one measured on the latter does not make a batch without padding
    look cheap in our loop."""
    from hf_ssd.control.memory import record_prefill

    ctl = controller()
    plain_plan, sync = Plan("plain"), Plan("sync", 3)

    def prefill(plan, share):
        pred = ctl.predict(plan)
        ctl._price_call(pred, Horizon(tokens=64, context=300, prefill_share=share), None)
        return pred.parts["prefill"]

    column_s = 0.01  # both paths: 10 ms per prompt column of the padded batch
    for share in (0.85, 0.85, 0.44):  # our loop ran these shares of the padded batches' tokens
        record_prefill(ctl.memory, "engine", column_s * 300 * share, 300 * share)
        record_prefill(ctl.memory, "plain", column_s * 300, 300)
    assert prefill(plain_plan, 0.44) == pytest.approx(column_s * 300 * 0.56)  # what grouping saves here
    assert prefill(plain_plan, 1.0) == pytest.approx(0.0) and prefill(sync, 1.0) == pytest.approx(0.0)
    assert prefill(sync, 0.44) == 0.0


def test_generate_records_our_prefill_per_padded_column(monkeypatch):
    """generate() divides our loop's measured prefill by the padded columns it stands for (width x share)."""
    from hf_ssd import session
    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.control import memory as memory_mod
    from hf_ssd.runtime.prefill import grouped_share

    memory, seen = Memory(), []
    monkeypatch.setattr(session, "memory_for", lambda key: memory)
    monkeypatch.setattr(ctl_mod.Controller, "decide",
                        lambda self, current=None, horizon=None: ctl_mod.Decision(Plan("sync", 2), "test", []))
    real = memory_mod.record_prefill
    monkeypatch.setattr("hf_ssd.hf.generate.record_prefill",
                        lambda m, path, seconds, columns: seen.append((path, seconds, columns)) or real(
                            m, path, seconds, columns))
    p = get_pair("llama")
    ids, mask = left_pad([prompt(300, seed=11)[0], prompt(4, seed=12)[0], prompt(5, seed=13)[0]])
    out = p.target.generate(ids, attention_mask=mask, assistant_model=p.related, ssd=True, max_new_tokens=3,
                            do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    share = grouped_share(mask[:, :-1].bool(), 64)
    assert [s[0] for s in seen] == ["engine"]
    assert seen[0][1] == pytest.approx(out.ssd_stats["target_prefill_s"], abs=1e-4)
    assert seen[0][2] == pytest.approx((ids.shape[1] - 1) * share) and share < 0.5
