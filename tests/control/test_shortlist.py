"""Decisions between full evaluations predict only a shortlist of plans (control.shortlist), and choose as well as a
full evaluation would, within the 5% every decision is held to."""
from __future__ import annotations

import random

import pytest

from hf_ssd.control import shortlist as shortlist_mod
from hf_ssd.control.controller import Controller
from hf_ssd.control.memory import Memory
from hf_ssd.control.plan import Plan

from tests.control.test_controller import costs


def _controller(c, alpha: float, batch: int = 1, memory: Memory | None = None) -> Controller:
    return Controller(c, memory or Memory(), batch, {}, fixed_alpha=alpha, process_ready=True)


def _counting(monkeypatch, ctl: Controller) -> list[Plan]:
    seen: list[Plan] = []
    predict = ctl.predict

    def counted(plan, *args, **kwargs):
        seen.append(plan)
        return predict(plan, *args, **kwargs)

    monkeypatch.setattr(ctl, "predict", counted)
    return seen


def test_decisions_between_full_evaluations_predict_only_the_shortlist(monkeypatch):
    ctl = _controller(costs(int8=(0.01, 0.0003)), alpha=0.8)
    seen = _counting(monkeypatch, ctl)
    first = ctl.decide()
    assert set(seen) == set(ctl.plans) and len(ctl.plans) > 150  # the first decision is a full evaluation
    shortlist = ctl.memory.shortlist
    assert first.plan in shortlist.plans and len(shortlist.plans) < len(ctl.plans) / 4
    for _ in range(shortlist_mod.SHORTLIST_EVERY):
        seen.clear()
        ctl.decide(current=first.plan)
        assert set(seen) <= shortlist.plans | {first.plan}
    seen.clear()
    ctl.decide(current=first.plan)  # its decisions are used up: a full evaluation again
    assert set(seen) == set(ctl.plans)


def test_a_move_in_alpha_brings_a_full_evaluation_back(monkeypatch):
    """The best budget of each K moves with α: a shortlist made at α = 0.7 is not used at α = 0.7 + the allowed
    move (a code answer after chat ones), while a smaller move keeps it."""
    memory = Memory()
    _controller(costs(), alpha=0.7, memory=memory).decide()
    near = _controller(costs(), alpha=0.7 + shortlist_mod.SHORTLIST_ALPHA_MOVE / 2, memory=memory)
    seen = _counting(monkeypatch, near)
    near.decide()
    assert set(seen) < set(near.plans)
    moved = 0.7 + 1.01 * shortlist_mod.SHORTLIST_ALPHA_MOVE
    far = _controller(costs(), alpha=moved, memory=memory)
    seen = _counting(monkeypatch, far)
    far.decide()
    assert set(seen) == set(far.plans)
    assert memory.shortlist.alpha == pytest.approx(moved)


def test_other_candidates_get_a_full_evaluation(monkeypatch):
    memory = Memory()
    _controller(costs(), alpha=0.8, memory=memory).decide()
    fixed_k = Controller(costs(), memory, 1, {"K": (3,)}, fixed_alpha=0.8, process_ready=True)
    seen = _counting(monkeypatch, fixed_k)
    assert fixed_k.decide().plan.K == 3
    assert set(seen) == set(fixed_k.plans)


def test_the_shortlist_chooses_as_well_as_a_full_evaluation_as_alpha_and_costs_move():
    """The call's α moves between decisions (a code answer after a chat one), and so does the machine: a decision
    on the shortlist of the last full evaluation is never predicted more than 5% slower than a full one's choice."""
    rng = random.Random(0)
    same = 0
    trials = 150
    for _ in range(trials):
        batch = rng.choice([1, 4, 16])
        made = costs(verify=(rng.uniform(0.01, 1), rng.uniform(0, 0.05)),
                     draft=(rng.uniform(0.001, 0.5), rng.uniform(0, 0.02)), split=rng.uniform(0.8, 2.5), batch=batch,
                     int8=rng.choice([None, (rng.uniform(0.001, 0.3), rng.uniform(0, 0.01))]))
        ctl = _controller(made, rng.uniform(0.05, 0.99), batch)
        ctl.decide()  # the full evaluation that makes the shortlist
        ctl.fixed_alpha = min(0.99, max(0.05, ctl.fixed_alpha + rng.uniform(-0.35, 0.35)))
        later = _controller(made, ctl.fixed_alpha, batch)  # what a full evaluation would say now
        on_shortlist, full = ctl.decide().plan, later.decide().plan
        same += on_shortlist == full
        assert ctl.predict(on_shortlist).tokens_per_s >= 0.95 * ctl.predict(full).tokens_per_s
    assert same >= 0.8 * trials
