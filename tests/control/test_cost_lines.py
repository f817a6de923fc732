"""Cost curves: what a forward of n tokens per row costs, measured at the widths plans use. The kernels change with
n: on the project's CPU the default pair's target takes 0.37 s for 1 token, 0.80 s for 2, 1.15 s for 3 and 0.78 s
for 4 (two and three rows run as that many matrix-vector products), so no straight line fits."""
from __future__ import annotations

import pytest

from hf_ssd.control import costs as costs_mod
from hf_ssd.control.controller import Controller
from hf_ssd.control.memory import Memory
from hf_ssd.control.costs import Costs, Curve, measure_curve
from hf_ssd.control.plan import Plan

# seconds per forward of n tokens, as measured for the default pair's target on two cores
MEASURED = {1: 0.37, 2: 0.80, 3: 1.15, 4: 0.78, 6: 0.86, 9: 0.89}
STRAIGHT = Curve.straight(0.305, 0.065)  # the old line through 1 and 9 tokens


def test_a_curve_reads_between_and_past_its_points():
    curve = Curve(tuple(MEASURED.items()))
    assert curve(1) == 0.37 and curve(3) == 1.15 and curve(4) == 0.78
    assert curve(5) == pytest.approx(0.82) and curve(0.5) == 0.37
    assert curve(17) == pytest.approx(0.89 + 0.01 * 8)  # along the last two points
    assert Curve(((1, 0.5), (4, 0.4)))(8) == 0.4  # never downhill past the last point


def test_measuring_times_every_width_a_verify_uses(monkeypatch):
    asked = []

    def fake_widths(model, batch, widths, prefix=8, packed=True):
        asked.append(widths)
        return {n: MEASURED.get(n, 0.9) for n in widths}

    monkeypatch.setattr(costs_mod, "time_widths", fake_widths)
    curve = measure_curve(None, 1, 9, None)
    assert asked == [(1, 2, 3, 4, 6, 9)]
    assert curve(3) == pytest.approx(1.15)  # the straight line said 0.50
    assert measure_curve(None, 1, 16, None)(16) == pytest.approx(0.9) and asked[-1][-1] == 16


def test_a_thread_setting_asked_twice_is_timed_once_with_two_passes(monkeypatch):
    """The paper setting gives the target one thread alone and one thread beside the draft: the same forward. It is
    timed in two passes and each width keeps its fastest (a slow pass is the machine's interruption); a setting
    asked once is timed once."""
    passes = iter([{1: 0.40, 2: 0.80}, {1: 0.37, 2: 0.95}])
    calls = []

    def fake_widths(model, batch, widths, prefix=8, packed=True):
        calls.append((model, widths))
        return next(passes) if model == "target" else {n: 0.1 * n for n in widths}

    monkeypatch.setattr(costs_mod, "time_widths", fake_widths)
    monkeypatch.setattr(costs_mod, "WIDTHS", (1, 2))
    alone, beside, draft = costs_mod.measure_curves(1, [("target", 2, 1), ("target", 2, 1), ("draft", 2, 1)])
    assert alone is beside and alone.points == ((1, 0.37), (2, 0.80))
    assert [m for m, _ in calls] == ["target", "target", "draft"]
    assert draft(2) == pytest.approx(0.2)


def test_a_verify_that_costs_what_it_measures_moves_a_running_small_k_up():
    """At α = 0.8 a synchronous call running K=2 (a 3-token verify: 1.15 s) gains by drafting more, as a K=3..8
    verify costs 0.8-0.9 s; priced by the straight line, K=2's verify looked like 0.50 s and it stayed (the default
    pair's paper-setting bench at K=2: our SD at 0.72x plain)."""
    draft = Curve.straight(0.030, 0.001)

    def decide_from_K2(target):
        costs = Costs(1, target, draft, target, draft, None)
        ctl = Controller(costs, Memory(), 1, {"mode": ("sync",)}, fixed_alpha=0.8)
        return ctl.decide(current=Plan("sync", 2))

    moved = decide_from_K2(Curve(tuple(MEASURED.items())))
    assert moved.plan.K >= 4, moved.reason
    assert decide_from_K2(STRAIGHT).plan == Plan("sync", 2)


def test_the_first_decode_forward_after_the_prefill_is_not_timed(monkeypatch):
    """The first forward of a new shape sets up its kernels: timed as the one-token width, it priced the default
    pair's plain step 35% over what plain decoding then ran at. A slow first decode forward stays out of the curve.
    A fake clock: every forward takes 1 ms of it, the first decode-shaped one 300 ms (a loaded machine's real clock
    could stall any forward)."""
    from types import SimpleNamespace

    from hf_ssd.testing import tiny_llama

    model = tiny_llama().eval()
    widths, clock = [], [0.0]

    def slow_first_decode(module, args, kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        clock[0] += 0.3 if len(widths) == 2 else 0.001  # the prefill, then the first decode-shaped forward

    monkeypatch.setattr(costs_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    model.register_forward_pre_hook(slow_first_decode, with_kwargs=True)
    seconds = costs_mod.time_widths(model, 1, (1, 2))
    assert widths == [8, 1, 1, 2]
    assert seconds == {1: pytest.approx(0.001), 2: pytest.approx(0.001)}


def test_plain_is_priced_at_our_one_token_step():
    """The plain hand-off runs transformers' loop through the same packed kernel as our forwards (where the target
    is packed): plain decoding costs our one-token step, a sync round our verify block and drafts."""
    from hf_ssd.control.plan import Acceptance, predict

    ours = Curve.straight(0.10, 0.01)  # packed: a verify block costs little more than one token
    costs = Costs(1, ours, ours, ours, ours, None)
    assert predict(Plan("plain"), costs, Acceptance(alpha=0.7), 1).round_s == pytest.approx(ours(1))
    sync = predict(Plan("sync", K=4), costs, Acceptance(alpha=0.7), 1)
    assert sync.parts["verify"] == pytest.approx(ours(5))
