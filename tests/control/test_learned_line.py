"""Compiled plans are priced off what their rounds measured (control.learned_line), not off the eager cost lines
scaled by one ratio: a measured compiled plan's siblings are priced by their size in forwards."""
from __future__ import annotations

import pytest

from hf_ssd.control.controller import Controller
from hf_ssd.control.costs import Costs, Curve
from hf_ssd.control.learned_line import BRANCH_SHARE, LearnedLine, tree_forwards
from hf_ssd.control.memory import Memory
from hf_ssd.control.plan import Plan


def test_one_size_seen_extrapolates_in_proportion_or_flat():
    tree, verify = LearnedLine(proportional=True), LearnedLine(proportional=False)
    assert tree(4) is None and not tree
    for _ in range(5):
        tree.add(4, 0.008)
        verify.add(4, 0.003)
    assert tree(8) == pytest.approx(0.016) and tree(2) == pytest.approx(0.004)
    assert verify(9) == pytest.approx(0.003)


def test_one_size_seen_with_its_forwards_timed_keeps_its_fixed_work():
    """A K = 2 tree took 6 ms, 1.2 ms of it per forward: a K = 8 tree adds only forwards to it (in proportion, it
    was priced 3x, and K = 8 no faster than K = 2 at α = 1)."""
    line = LearnedLine(proportional=True)
    for _ in range(5):
        line.add(3.0, 0.006, 0.0012)
    assert line(9.0) == pytest.approx(0.006 + 6 * 0.0012)
    assert line(1.0) == pytest.approx(0.0036)
    line.add(3.0, 0.006, 0.01)  # forwards that took longer than the whole tree: a bad reading, not kept
    assert line.unit.value == pytest.approx(0.0012)


def test_sizes_seen_fit_a_line_that_never_goes_downhill():
    line = LearnedLine(proportional=True)
    for x, seconds in ((5, 0.0067), (9, 0.0103), (13, 0.0139)):
        for _ in range(5):
            line.add(x, seconds)
    assert line(7) == pytest.approx(0.0085) and line(1) == pytest.approx(0.0031)  # fixed 2.2 ms + 0.9 ms a forward
    noisy = LearnedLine(proportional=False)
    for x, seconds in ((3, 0.005), (9, 0.004)):
        for _ in range(5):
            noisy.add(x, seconds)
    assert noisy(3) == noisy(20) == pytest.approx(0.0045)  # a slope below zero is noise: flat at the mean


def test_tree_size_counts_forwards_and_a_share_per_branch():
    assert tree_forwards(Plan("ssd", 4, 2)) == pytest.approx(5 + BRANCH_SHARE * 4)
    assert tree_forwards(Plan("ssd", 8, 9)) == pytest.approx(9 + BRANCH_SHARE * 8 * 8)
    assert tree_forwards(Plan("sync", 4)) == 4


def _noisy_costs() -> Costs:
    """Eager lines of a small model on a busy CPU: neighbouring widths 2-3x apart (12 tokens far above 16)."""
    target = Curve(((1, 0.014), (2, 0.017), (3, 0.020), (4, 0.020), (6, 0.020), (9, 0.021)))
    draft = Curve(((1, 0.005), (2, 0.005), (3, 0.013), (4, 0.013), (6, 0.009), (9, 0.010), (12, 0.016),
                   (16, 0.006)))
    return Costs(1, target, draft, target, draft, (1, 1))


def _measured(ctl: Controller, plan: Plan, round_s: float, verify_s: float, tree_s: float) -> None:
    for _ in range(8):
        ctl.memory.record_round(plan, round_s, tokens=plan.K + 1)
        ctl.record_verify(plan, verify_s)
        ctl.record_draft(plan, tree_s)


def test_a_measured_compiled_plan_prices_its_siblings_by_their_forwards():
    """SSD K = 3 with 16 branches, compiled, measured 6.6 ms a round (tree 5 ms, verify 4.5 ms). Scaled by its one
    ratio, the noisy eager lines priced K = 3 with 12 branches at twice its round and every longer tree far slower,
    so the first plan was kept; priced by forwards, narrower trees cost less and at α = 1 a longer K wins."""
    measured = Plan("ssd", 3, 16, "thread", threads=(1, 1))
    narrower = Plan("ssd", 3, 12, "thread", threads=(1, 1))

    def make(compiled: bool) -> Controller:
        ctl = Controller(_noisy_costs(), Memory(), 1, {"mode": ("ssd",)}, fixed_alpha=1.0,
                         plain_compiled=compiled, draft_compiled=compiled)
        ctl.memory.guessability.add([400] + [0] * 16)  # the bonus is always the first guess (α = 1)
        _measured(ctl, measured, 0.0066, 0.0045, 0.0050)
        return ctl

    eager = make(compiled=False)  # the premise: the eager lines' noise alone
    assert eager.predict(narrower).round_s > 1.5 * eager.predict(measured).round_s
    ctl = make(compiled=True)
    assert ctl.predict(measured).round_s == pytest.approx(0.0066)
    assert ctl.predict(narrower).round_s < ctl.predict(measured).round_s
    longer = ctl.predict(Plan("ssd", 8, 9, "thread", threads=(1, 1)))
    assert longer.parts["tree"] == pytest.approx(0.0050 * tree_forwards(longer.plan) / tree_forwards(measured))
    assert longer.tokens_per_s > ctl.predict(measured).tokens_per_s
    assert ctl.decide().plan.K > 3


def test_a_family_that_has_not_run_borrows_the_measured_lines_where_cheaper():
    """Compiled sync SD has not run: its draft steps are priced off the SSD trees' line (a forward is a forward)
    and its verify by the verifies' measured ratio to the eager line, never above the eager price."""
    ctl = Controller(_noisy_costs(), Memory(), 1, {}, fixed_alpha=0.9, plain_compiled=True, draft_compiled=True)
    ssd = Plan("ssd", 3, 16, "thread", threads=(1, 1))
    eager_verify = ctl.model(Plan("sync", 4)).parts["verify"]
    _measured(ctl, ssd, 0.0066, 0.0045, 0.0050)
    sync = ctl.model(Plan("sync", 4)).parts
    assert sync["draft"] == pytest.approx(0.0050 * 4 / tree_forwards(ssd))
    assert sync["verify"] < eager_verify and sync["verify"] == pytest.approx(
        eager_verify * ctl.memory.verify.value)
    slow = Controller(_noisy_costs(), Memory(), 1, {}, fixed_alpha=0.9, draft_compiled=True)
    _measured(slow, ssd, 0.5, 0.2, 0.4)  # a measured tree far slower than the eager lines: not borrowed
    assert slow.model(Plan("sync", 4)).parts["draft"] == pytest.approx(
        Controller(_noisy_costs(), Memory(), 1, {}, fixed_alpha=0.9).model(Plan("sync", 4)).parts["draft"])


def test_a_tree_borrows_the_synchronous_steps_scaled_to_its_width():
    """Compiled SSD has not run, compiled sync SD has. Where the eager lines say wide forwards cost more (a batch of
    16 rows x 16 branches is compute, not launches), the tree is priced off the synchronous steps times that width
    factor, not as if each of its forwards were one row wide, and not capped at the eager price: the synchronous
    side ran alone, so where its steps and verifies measured slower than the eager lines (a long context), no
    family's are faster. Another worker's measured trees it borrows as they are."""
    draft = Curve(((1, 0.004), (2, 0.005), (3, 0.006), (4, 0.007), (6, 0.009), (9, 0.012), (16, 0.032)))
    target = Curve(((1, 0.010), (2, 0.012), (3, 0.014), (4, 0.016), (6, 0.020), (9, 0.026)))
    ctl = Controller(Costs(16, target, draft, target, draft, (1, 1)), Memory(), 16, {}, fixed_alpha=0.7,
                     plain_compiled=True, draft_compiled=True)
    sync, tree = Plan("sync", 2), Plan("ssd", 2, 16, "thread", threads=(1, 1))
    _measured(ctl, sync, 0.004, 0.003, 0.002)  # compiled: a step 1 ms, a quarter of the eager one-token step
    eager = predict_eagerly(ctl, tree)
    factor = eager["tree"] / (tree_forwards(tree) * draft(1))
    assert factor > 2  # the premise: a 16-branch step is wide here
    assert ctl.model(tree).parts["tree"] == pytest.approx(factor * 0.002 * tree_forwards(tree) / 2)
    assert ctl.model(tree).parts["tree"] < eager["tree"]
    assert ctl.model(tree).parts["backup"] == pytest.approx(0.002)  # K one-token steps: no width to scale
    long_context = Controller(ctl.costs, Memory(), 16, {}, fixed_alpha=0.7, plain_compiled=True, draft_compiled=True)
    _measured(long_context, sync, 0.08, 0.06, 0.02)  # a 1024-slot static cache: steps and verify above the lines
    priced = long_context.model(tree).parts
    assert priced["tree"] == pytest.approx(factor * 0.02 * tree_forwards(tree) / 2) and priced["tree"] > eager["tree"]
    assert priced["verify"] == pytest.approx(0.06) and priced["verify"] > eager["verify"]
    on_a_process = Plan("ssd", 2, 16, "process", threads=(1, 1))
    _measured(ctl, on_a_process, 0.006, 0.003, 0.005)
    assert ctl.model(tree).parts["tree"] == pytest.approx(0.005)  # a tree is a tree, whichever worker built it


def predict_eagerly(ctl: Controller, plan: Plan) -> dict:
    from hf_ssd.control.plan import predict

    return predict(plan, ctl.costs, ctl.acceptance(plan.int8), ctl.batch).parts


def test_sizes_closer_than_a_forward_fit_no_slope():
    """Two budgets of one K are 0.4 forwards apart: their difference is noise, not a slope."""
    line = LearnedLine(proportional=True)
    for x, seconds in ((3.66, 0.0077), (3.3, 0.0079)):
        for _ in range(5):
            line.add(x, seconds)
    assert line(9.0) == pytest.approx(0.0078 * 9.0 / 3.48)


def test_a_compiled_rounds_own_work_is_priced_as_seconds_not_as_a_ratio():
    """SSD K = 2 ran 12 ms rounds: an 8 ms tree (2 ms a forward), a 6 ms verify, 4 ms of the engine's own work.
    Those 4 ms are the same for a K = 8 round; as a ratio (1.5x) they priced it no faster than K = 2 at α = 1."""
    k2 = Plan("ssd", 2, 16, "thread", threads=(1, 1))
    ctl = Controller(_noisy_costs(), Memory(), 1, {"mode": ("ssd",)}, fixed_alpha=1.0, plain_compiled=True,
                     draft_compiled=True)
    ctl.memory.guessability.add([400] + [0] * 16)
    for _ in range(8):
        ctl.memory.record_round(k2, 0.012, tokens=3)
        ctl.record_verify(k2, 0.006)
        ctl.record_draft(k2, 0.008, 0.002)
    k8 = Plan("ssd", 8, 9, "thread", threads=(1, 1))
    tree = 0.008 + 0.002 * (tree_forwards(k8) - tree_forwards(k2))
    assert ctl.predict(k8).round_s == pytest.approx(tree + 0.004, rel=0.01)  # (and a rare miss's backup)
    assert ctl.predict(k8).tokens_per_s > 1.3 * ctl.predict(k2).tokens_per_s
    assert ctl.decide().plan.K >= 5
