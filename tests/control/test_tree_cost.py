"""A compiled tree whose forwards were timed by width prices other trees forward by forward (control.tree_cost):
a wide, shallow tree's forwards do not make a narrow, deep one look slow."""
from __future__ import annotations

import pytest

from hf_ssd.control.controller import Controller
from hf_ssd.control.costs import Costs, Curve
from hf_ssd.control.learned_line import LearnedLine, tree_forwards
from hf_ssd.control.memory import Memory
from hf_ssd.control.plan import Plan
from hf_ssd.control.tree_cost import WIDTH_SHARE, TreeCost
from hf_ssd.draft.static_saguaro import _forwards_since


def _forward_s(width: float) -> float:
    """A compiled draft forward on the project's CPU, roughly: 0.7 ms plus 0.07 ms per token of width."""
    return 0.0007 + 0.00007 * width


REST_PER_FORWARD = 0.0002  # the tree's own work between its forwards


def _tree(plan: Plan) -> tuple[float, dict]:
    """A tree of `plan` as the drafter reports it: its seconds and its forwards by width (glue, then K steps)."""
    forwards = {plan.budget: (plan.K * _forward_s(plan.budget), plan.K)}
    s, c = forwards.get(plan.K + 1, (0.0, 0))  # the glue, which may share the steps' width
    forwards[plan.K + 1] = (s + _forward_s(plan.K + 1), c + 1)
    seconds = sum(s for s, _ in forwards.values()) + REST_PER_FORWARD * (plan.K + 1)
    return seconds, forwards


def _truth(plan: Plan) -> float:
    return _tree(plan)[0]


def test_a_wide_shallow_tree_prices_a_narrow_deep_one_by_its_widths():
    wide = Plan("ssd", 2, 16, "process")
    cost = TreeCost()
    assert not cost
    for _ in range(6):
        cost.add(*_tree(wide))
    assert cost
    assert cost.tree(wide) == pytest.approx(_truth(wide))
    for plan in (Plan("ssd", 8, 2, "process"), Plan("ssd", 4, 8, "process"), Plan("ssd", 8, 9, "process")):
        assert cost.tree(plan) == pytest.approx(_truth(plan), rel=0.01)
    deep = Plan("ssd", 8, 2, "process")
    assert cost.backup(deep) == pytest.approx(8 * _forward_s(1) + REST_PER_FORWARD * 8, rel=0.01)
    # the premise: a size in forwards with a fixed share per branch, from the same trees and their mean forward,
    # overprices it by a third
    line = LearnedLine(proportional=True)
    seconds, forwards = _tree(wide)
    for _ in range(6):
        line.add(tree_forwards(wide), seconds, sum(s for s, _ in forwards.values()) / (wide.K + 1))
    assert line(tree_forwards(deep)) > 1.3 * _truth(deep)


def test_one_width_seen_prices_other_widths_by_the_prior_slope():
    """K = 8 with 9 branches times only forwards 9 wide (glue and steps): a line through one width is flat, and a
    tree of 2 branches would cost as much as one of 9. Until the widths seen span FIT_SPREAD, a forward's width
    costs WIDTH_SHARE of a forward of no width per token, so the narrower tree is priced cheaper, as it runs."""
    only = Plan("ssd", 8, 9, "process")
    cost = TreeCost()
    for _ in range(6):
        cost.add(*_tree(only))
    assert cost.tree(only) == pytest.approx(_truth(only))  # what ran is priced as it ran
    narrow, wide = Plan("ssd", 8, 2, "process"), Plan("ssd", 8, 16, "process")
    assert cost.tree(narrow) < 0.8 * cost.tree(only) < 0.8 * cost.tree(wide)
    per_token = cost.forward_s(10) - cost.forward_s(9)
    assert per_token == pytest.approx(WIDTH_SHARE * (cost.forward_s(9) - 9 * per_token))
    # widths far enough apart: the line through them, as timed
    cost.add(*_tree(Plan("ssd", 2, 16, "process")))
    assert cost.forward_s(2) == pytest.approx(_forward_s(2), rel=0.05)


def test_bad_readings_leave_the_lines_alone():
    cost = TreeCost()
    cost.add(0.0, {3: (0.001, 1)})  # no tree time
    cost.add(0.005, {})  # no forwards timed
    assert not cost
    cost.add(0.001, {3: (0.0008, 1), 16: (0.004, 2)})  # forwards longer than the tree's clock: rest floored
    assert 0 < cost.rest(3) < 1e-5


def _costs() -> Costs:
    target = Curve(((1, 0.010), (2, 0.011), (3, 0.012), (4, 0.013), (6, 0.015), (9, 0.018)))
    draft = Curve(((1, 0.003), (2, 0.0035), (3, 0.004), (4, 0.0045), (6, 0.0055), (9, 0.007), (16, 0.011)))
    return Costs(1, target, draft, target, draft, (1, 1))


def test_the_controller_prices_compiled_trees_off_their_timed_forwards():
    """SSD K = 2 with 16 branches ran on the draft process with its forwards timed: at α = 1 SSD K = 8 with 2
    branches is then priced at what its forwards cost (the plan that ran fastest on the overhead workload), and a
    thread plan that has not run borrows the process's trees."""
    ctl = Controller(_costs(), Memory(), 1, {"mode": ("ssd",)}, fixed_alpha=1.0, process_ready=True,
                     plain_compiled=True, draft_compiled=True)
    wide, deep = Plan("ssd", 2, 16, "process"), Plan("ssd", 8, 2, "process")
    for _ in range(8):
        seconds, forwards = _tree(wide)
        ctl.record_draft(wide, seconds, sum(s for s, _ in forwards.values()) / 3, forwards)
    parts = ctl.model(deep).parts
    assert parts["tree"] == pytest.approx(_truth(deep), rel=0.01)
    assert parts["backup"] == pytest.approx(8 * _forward_s(1) + REST_PER_FORWARD * 8, rel=0.01)
    thread = Plan("ssd", 8, 2, "thread", threads=(1, 1))
    eager_tree = Controller(_costs(), Memory(), 1, {}, fixed_alpha=1.0).model(thread).parts["tree"]
    assert ctl.model(thread).parts["tree"] == pytest.approx(min(_truth(deep), eager_tree), rel=0.01)


def test_a_family_whose_trees_ran_untimed_keeps_its_own_line():
    """On a GPU a graph's launch returns before it has run, so no forward is timed: a family that ran there keeps
    pricing off its own trees, not another family's timed ones."""
    ctl = Controller(_costs(), Memory(), 1, {}, fixed_alpha=1.0, process_ready=True, draft_compiled=True)
    process, thread = Plan("ssd", 2, 16, "process"), Plan("ssd", 2, 16, "thread", threads=(1, 1))
    for _ in range(8):
        ctl.record_draft(process, *_tree(process)[:1], None, _tree(process)[1])
        ctl.record_draft(thread, 0.002)  # untimed trees of its own
    assert ctl.model(thread).parts["tree"] == pytest.approx(0.002)


def test_forwards_are_read_off_the_static_caches_per_width_timers():
    before = {3: (0.002, 2), 16: (0.010, 5)}
    now = {3: (0.003, 3), 16: (0.014, 7), 17: (0.001, 1)}
    assert _forwards_since(before, now) == {3: pytest.approx((0.001, 1)), 16: pytest.approx((0.004, 2)),
                                            17: (0.001, 1)}
    assert _forwards_since(now, now) == {}
