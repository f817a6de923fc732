"""Kept draft processes (workers.pool): when one may be started, when the controller asks for one, and exact output
while the controller's plans use it."""
from __future__ import annotations

import types

import pytest
import torch

from hf_ssd.control import controller as ctl_mod
from hf_ssd.control import drafter as drafter_mod
from hf_ssd.control.controller import Controller
from hf_ssd.control.decision import Horizon
from hf_ssd.control.memory import Memory
from hf_ssd.control.costs import Costs, Curve
from hf_ssd.control.plan import Plan, Prediction
from hf_ssd.testing import get_pair, left_pad, plain_generate, prompt
from hf_ssd.workers import pool


def costs(overlap: float) -> Costs:
    t, d = Curve.straight(0.10, 0.002), Curve.straight(0.02, 0.0005)
    return Costs(1, t, d, t, d, (1, 1), None, None, overlap=overlap)


@pytest.mark.parametrize("script, safe", [
    ('"""doc"""\nimport torch\nX = 3\ndef main():\n    run()\nif __name__ == "__main__":\n    main()\n', True),
    ("import torch\nmodel = load()\nif __name__ == '__main__':\n    pass\n", False),  # a call at import
    ("import torch\nrun()\n", False),
    ("if '__main__' == __name__:\n    run()\nelse:\n    other()\n", False),  # the else branch runs in the child
])
def test_spawn_hazard_reads_the_main_script(tmp_path, monkeypatch, script, safe):
    path = tmp_path / "main.py"
    path.write_text(script)
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    monkeypatch.setitem(__import__("sys").modules, "__main__", main)
    monkeypatch.setenv(pool.ENV, "1")
    hazard = pool.spawn_hazard()
    assert (hazard is None) == safe
    if not safe:
        assert "if __name__ ==" in hazard and "line" in hazard
    monkeypatch.setenv(pool.ENV, "0")
    assert "off" in pool.spawn_hazard()


def test_process_plans_are_candidates_only_when_a_process_is_up():
    plain = Controller(costs(0.5), Memory(), 1, {}, fixed_alpha=0.8)
    assert not any(p.worker == "process" for p in plain.plans)
    ready = Controller(costs(0.5), Memory(), 1, {}, fixed_alpha=0.8, process_ready=True)
    process = [p for p in ready.plans if p.worker == "process"]
    assert process and not any(p.int8 for p in process)
    fixed = Controller(costs(0.5), Memory(), 1, {"worker": "thread"}, fixed_alpha=0.8, process_ready=True)
    assert not any(p.worker == "process" for p in fixed.plans)


def test_a_process_is_asked_for_only_where_it_pays():
    # threads that hide nothing of each other (the GIL): a process worker is predicted clearly faster
    c = Controller(costs(0.0), Memory(), 1, {}, fixed_alpha=0.9)
    want = c.process_option(c.decide().plan)
    assert want is not None and want.plan.worker == "process" and want.plan.mode == "ssd"
    # threads that overlap fully: a process would only add its hand-over
    c = Controller(costs(1.0), Memory(), 1, {}, fixed_alpha=0.9)
    assert c.process_option(c.decide().plan) is None
    # the options fix the worker: nothing to ask for
    c = Controller(costs(0.0), Memory(), 1, {"worker": "thread"}, fixed_alpha=0.9)
    assert c.process_option(c.decide().plan) is None


def test_a_process_start_is_charged_until_the_setting_has_run_long_enough_to_repay_it():
    """With the call's horizon, the process plans pay the call's share of the process's start (spread over what
    the setting has generated, with this call): a start of 60 s is not repaid by one 64-token call, but is once
    the setting has generated enough; without a start cost the call-level verdict matches the per-round one."""
    c = Controller(costs(0.0), Memory(), 1, {}, fixed_alpha=0.9)
    chosen, horizon = c.decide().plan, Horizon(64, 32)
    assert c.process_option(chosen, horizon, start_s=0.0) is not None
    early = c.process_option(chosen, horizon, start_s=60.0)
    assert early is None
    c.memory.generated = 1e6  # a long-running program: the start's share of this call is small
    late = c.process_option(chosen, horizon, start_s=60.0)
    assert late is not None and late.plan.worker == "process"
    assert 0 < late.parts["process_start"] < 0.01 and late.call_tokens_per_s < late.tokens_per_s


def test_generation_asks_for_a_kept_process_when_it_ends(monkeypatch):
    started = []
    monkeypatch.setattr(pool, "start", lambda draft: started.append(draft) or "starting (test)")
    monkeypatch.setattr(ctl_mod.Controller, "process_option",
                        lambda self, chosen, horizon=None, start_s=0.0: Prediction(Plan("ssd", 3, 6, "process"), 12.0,
                                                                                   0.1))
    p = get_pair("llama")
    ids = prompt(6, seed=11)
    out = p.target.generate(ids, assistant_model=p.related, ssd=True, max_new_tokens=12, do_sample=False,
                            pad_token_id=0, return_dict_in_generate=True)
    assert started == [p.related]
    assert "kept draft process starting (test)" in out.ssd_stats["controller"]["process_worker"]


ROTATION = [Plan("ssd", 3, 6, "process"), Plan("sync", 2), Plan("ssd", 3, 6, "thread"), Plan("ssd", 4, 8, "process")]


def test_kept_process_serves_the_controllers_plans_exactly(monkeypatch):
    """A real kept process: once up, the controller's process plans run on it (switching to and from it between
    rounds), the output is plain generate()'s, and it stays up for the next call."""

    def decide(self, current=None, horizon=None):
        i = 0 if current is None else (ROTATION.index(current) + 1) % len(ROTATION)
        return ctl_mod.Decision(ROTATION[i], "test: rotate", [])

    monkeypatch.setattr(ctl_mod.Controller, "decide", decide)
    monkeypatch.setattr(drafter_mod, "CONFIRMATIONS", 1)  # each rotation switches at once
    monkeypatch.setattr(drafter_mod.ControlledDrafter, "_switch_could_pay", lambda self, verdict: True)  # to the end
    monkeypatch.setattr(drafter_mod, "DECIDE_SHARE", 1e9)  # however long deciding took
    monkeypatch.setenv(pool.ENV, "1")
    p = get_pair("llama")
    try:
        assert pool.start(p.related).startswith("starting")
        assert pool.wait(p.related, timeout_s=120) == "ready"
        ids, mask = left_pad([prompt(7, seed=3)[0], prompt(4, seed=4)[0]])
        ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=40)
        for _ in range(2):
            out = p.target.generate(ids, attention_mask=mask, assistant_model=p.related, ssd=True, max_new_tokens=40,
                                    do_sample=False, pad_token_id=0, return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
            record = out.ssd_stats["controller"]
            assert "kept draft process was up" in record["process_worker"]
            assert {s["to"] for s in record["switches"]} >= {"sync K=2", "ssd K=3 budget=6 thread"}
            assert pool.ready(p.related) is not None  # free again, and alive
    finally:
        pool.close_all()
    assert pool.status(p.related) is None


def test_explicit_process_worker_keeps_its_process_across_calls(monkeypatch):
    """ssd_worker="process" with every option set: the first call starts the draft's kept process, later calls run
    on the same one (no start-up per call), and the output is plain generate()'s. With the pool off, each call
    starts its own process, as before."""
    monkeypatch.setenv(pool.ENV, "1")
    p = get_pair("llama")
    ids = prompt(6, seed=21)
    ref = plain_generate(p.target, ids, max_new_tokens=16)
    kw = dict(assistant_model=p.related, ssd=True, ssd_mode="ssd", ssd_worker="process", ssd_num_draft_tokens=3,
              ssd_budget=6, ssd_draft_quantize=None, max_new_tokens=16, do_sample=False, pad_token_id=0)
    try:
        pids = []
        for _ in range(2):
            assert torch.equal(p.target.generate(ids, **kw), ref)
            pids.append(pool.ready(p.related).process.pid)
        assert pids[0] == pids[1]
        pool.close_all()
        monkeypatch.setenv(pool.ENV, "0")
        assert torch.equal(p.target.generate(ids, **kw), ref)
        assert pool.status(p.related) is None  # nothing kept: that call's process ended with it
    finally:
        pool.close_all()


def test_timings_taken_while_a_process_starts_are_not_recorded(monkeypatch):
    """A kept process's start-up takes CPU from the generations running meanwhile: their round times (and a plain
    hand-off's step time) are not the plans' own, so the controller does not learn them."""
    from hf_ssd import session
    from hf_ssd.control import controller as ctl_mod

    memory = Memory()
    monkeypatch.setattr(session, "memory_for", lambda key: memory)
    monkeypatch.setattr(pool, "starting", lambda: True)
    p = get_pair("llama")
    for plan in (Plan("sync", 2), Plan("plain")):
        monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None, plan=plan: ctl_mod.Decision(
            plan, "test", []))
        p.target.generate(prompt(6, seed=5), assistant_model=p.related, ssd=True, max_new_tokens=16,
                          do_sample=False, pad_token_id=0)
    assert memory.round_s == {} and memory.accepted > 0  # acceptance is still learned


def test_warmup_starts_the_kept_process_for_ssd_true(monkeypatch):
    """`hf_ssd.warmup(target, draft, draft_process=True)`: a server's start-up. The kept process is up when it
    returns, so the first ssd=True call may already choose process plans (the controller alone starts one only once
    it repays its start); exact output."""
    import hf_ssd

    monkeypatch.setenv(pool.ENV, "1")
    p = get_pair("llama")
    with pytest.raises(ValueError, match="draft_process=True"):
        hf_ssd.warmup(p.target, p.related)  # no budget: nothing to compile
    try:
        info = hf_ssd.warmup(p.target, p.related, draft_process=True, progress=False)
        assert info["draft_process"] == "ready" and info["compiled"] is False and pool.ready(p.related) is not None
        ids, mask = left_pad([prompt(6, seed=5)[0]])
        out = p.target.generate(ids, attention_mask=mask, assistant_model=p.related, ssd=True, max_new_tokens=24,
                                do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24))
        assert "kept draft process was up" in out.ssd_stats["controller"]["process_worker"]
    finally:
        pool.close_all()


def test_warmup_warns_when_the_kept_process_cannot_start(tmp_path, monkeypatch):
    """A main script that runs code at import would run it again in the spawned child: warmup(draft_process=True)
    starts nothing, and says so with the reason (a script without the guard is the usual cause)."""
    import hf_ssd

    path = tmp_path / "server.py"
    path.write_text("import hf_ssd\nmodel = load()\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    monkeypatch.setitem(__import__("sys").modules, "__main__", main)
    monkeypatch.setenv(pool.ENV, "1")
    p = get_pair("llama")
    with pytest.warns(RuntimeWarning, match=r"kept draft process is not up \(not started: .*if __name__ =="):
        info = hf_ssd.warmup(p.target, p.related, draft_process=True, progress=False)
    assert info["draft_process"].startswith("not started") and pool.ready(p.related) is None
