"""Cost lines: a forward of n tokens per row costs fixed + per_token·n, and a single token is its own point (it
runs matrix-vector kernels: on the project's CPU the default pair's target takes 0.37 s for one token, 0.82 s for
two and 0.89 s for nine)."""
from __future__ import annotations

import pytest

from hf_ssd.control import costs as costs_mod
from hf_ssd.control.controller import Controller, Memory
from hf_ssd.control.costs import Costs, Line, measure_line
from hf_ssd.control.plan import Plan

KINKED = {1: 0.37, 2: 0.82, 9: 0.89}  # seconds per forward of n tokens, as measured for the default pair's target


def test_a_single_token_is_its_own_point():
    line = Line(0.8, 0.01, one=0.37)
    assert line(1) == 0.37 and line(3) == pytest.approx(0.83) and line(9) == pytest.approx(0.89)
    assert Line(0.8, 0.01)(1) == pytest.approx(0.81)  # unmeasured: the line holds at 1 too


def test_measuring_keeps_the_single_token_apart(monkeypatch):
    monkeypatch.setattr(costs_mod, "time_forward", lambda model, batch, n, repeats=1: KINKED[n])
    line = measure_line(None, 1, 9, None)
    assert line(1) == pytest.approx(0.37)
    assert line(2) == pytest.approx(0.82) and line(9) == pytest.approx(0.89)
    assert line(3) == pytest.approx(0.83)  # a line through 1 and 9 said 0.50: small verifies looked cheap


def test_a_costly_small_verify_moves_a_running_small_k_up():
    """With every verify of 2..9 tokens costing about the same, a synchronous call running K=3 at α = 0.9 gains
    half again by drafting more, and the controller moves it; priced by the line through 1 and 9 tokens, the gain
    looked like 6%, under the 10% a switch needs, and it stayed at K=3 (the default pair's demo: 0.7x its own
    sync SD)."""
    draft = Line(0.030, 0.001, one=0.030)

    def decide_from_K3(target: Line):
        costs = Costs(1, target, draft, target, draft, None)
        ctl = Controller(costs, Memory(), 1, {"mode": ("sync",)}, fixed_alpha=0.9)
        return ctl.decide(current=Plan("sync", 3))

    kinked = Line.through(2, KINKED[2], 9, KINKED[9])
    kinked = Line(kinked.fixed, kinked.per_token, one=KINKED[1])
    moved = decide_from_K3(kinked)
    assert moved.plan.K >= 7, moved.reason
    assert decide_from_K3(Line.through(1, KINKED[1], 9, KINKED[9])).plan == Plan("sync", 3)
