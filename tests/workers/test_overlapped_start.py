"""A draft process prefills while the target does (Drafter.prepare): the draft's start is sent before the target's
prefill, the output stays plain generate()'s, and a start that fails in the child still falls back exactly. The
controller overlaps only where it pays (Controller.prefill_overlap) and prices each family's starts apart."""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import hf_ssd  # noqa: F401
from hf_ssd.control.controller import Controller
from hf_ssd.control.decision import Decision
from hf_ssd.control.costs import Costs, Curve
from hf_ssd.control.drafter import ControlledDrafter
from hf_ssd.control.memory import Memory
from hf_ssd.control.plan import Plan
from hf_ssd.draft.protocol import Drafter
from hf_ssd.runtime import kv as kv_mod
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.testing import worker_pair
from hf_ssd.workers.process_drafter import ProcessDrafter

SSD = dict(ssd=True, ssd_mode="ssd", ssd_num_draft_tokens=4, ssd_draft_quantize=None, ssd_budget=6)
PROCESS = Plan("ssd", 4, 6, "process", threads=(1, 1))


@pytest.fixture(scope="module")
def pair():
    return worker_pair((2, 11), seed=3, padded={1: 3})


def test_the_draft_process_starts_before_the_targets_prefill(pair, monkeypatch):
    target, draft, prompts, mask = pair
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False)
    events: list[str] = []
    forward, send = kv_mod.CachedModel.forward, ProcessDrafter._send_start

    def recording_forward(self, *args, prefill=False, **kwargs):
        events.append("target prefill" if prefill else "target verify")
        return forward(self, *args, prefill=prefill, **kwargs)

    def recording_send(self, *args):
        events.append("draft start")
        return send(self, *args)

    monkeypatch.setattr(kv_mod.CachedModel, "forward", recording_forward)
    monkeypatch.setattr(ProcessDrafter, "_send_start", recording_send)
    with hf_ssd.DraftProcess(draft) as worker:
        out = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False,
                              assistant_model=draft, **SSD, ssd_worker=worker)
    assert torch.equal(out, ref)
    assert events[:2] == ["draft start", "target prefill"]
    assert events.count("draft start") == 1


def test_a_start_that_fails_in_the_child_falls_back_exactly(pair, monkeypatch):
    """The overlapped start's failure surfaces where a start's always did: the engine warns and goes on."""
    target, draft, prompts, mask = pair
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False)
    monkeypatch.setattr(ProcessDrafter, "_send_start", lambda self, prompt, mask: self.worker.send("start"))
    with pytest.warns(RuntimeWarning, match="draft process failed"):
        out = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False,
                              assistant_model=draft, **SSD, ssd_worker="process")
    assert torch.equal(out, ref)


def _controller(compute_bound: bool) -> Controller:
    """Launch-bound forwards cost the same on one thread as on two; compute-bound ones (a large model on a CPU)
    take twice as long on half the cores."""
    per_token = 0.004
    t_all, d = Curve.straight(0.02, per_token), Curve.straight(0.006, per_token / 4)
    t_split = Curve.straight(0.02, 2 * per_token) if compute_bound else t_all
    return Controller(Costs(1, t_all, d, t_split, d, (1, 1)), Memory(), 1, {}, fixed_alpha=0.8)


def test_prefills_overlap_where_launches_bound_them_and_not_where_cores_do():
    assert _controller(compute_bound=False).prefill_overlap(PROCESS, 400) == pytest.approx(0.0)
    assert _controller(compute_bound=True).prefill_overlap(PROCESS, 400) is None
    for plan in (Plan("sync", 4), Plan("ssd", 4, 6, "thread", threads=(1, 1)), Plan("plain")):
        assert _controller(compute_bound=False).prefill_overlap(plan, 400) is None
    # a thread on its own CUDA stream (a GPU's costs have no split of the cores) overlaps too
    gpu = _controller(compute_bound=False)
    gpu.costs = Costs(1, gpu.costs.target_all, gpu.costs.draft_all, gpu.costs.target_all, gpu.costs.draft_all, None)
    assert gpu.prefill_overlap(Plan("ssd", 4, 6, "thread"), 400) == pytest.approx(0.0)


def test_a_thread_worker_on_a_cpu_starts_after_the_prefill(pair):
    """Both sides would share the cores and the GIL: the thread worker overlaps only on its own CUDA stream."""
    from hf_ssd.config import SSDConfig
    from hf_ssd.draft.model import DraftModel
    from hf_ssd.draft.saguaro import SaguaroDrafter
    from hf_ssd.workers.thread import ThreadDrafter

    target, draft, prompts, mask = pair
    stats = SSDStats()
    inner = SaguaroDrafter(DraftModel(draft, 2, 96, [], True, 1.0, None), SSDConfig(num_draft_tokens=4), stats, 6, True)
    drafter = ThreadDrafter(inner, None)
    try:
        assert drafter.prepare(prompts, mask) is False
        assert drafter.start(prompts, mask).tokens.shape[0] == 2
    finally:
        drafter.close()


class Recorder(Drafter):
    """Records which protocol calls reach it; its start is an empty speculation."""

    kind = "fake"

    def __init__(self):
        self.calls: list[str] = []

    def prepare(self, prompt, mask) -> bool:
        self.calls.append("prepare")
        return True

    def start(self, prompt, mask):
        self.calls.append("start")

    def resolve(self, verdict):
        raise AssertionError("not reached")


@pytest.mark.parametrize("compute_bound", [False, True])
def test_the_controlled_drafter_overlaps_only_where_it_pays(compute_bound):
    ctl = _controller(compute_bound)
    built: list[Recorder] = []
    drafter = ControlledDrafter(ctl, lambda plan: built.append(Recorder()) or built[-1], SSDStats(),
                                Decision(PROCESS, "test", []))
    prompt = torch.zeros(1, 400, dtype=torch.long)
    assert drafter.prepare(prompt, torch.ones_like(prompt)) == (not compute_bound)
    drafter.start(prompt, torch.ones_like(prompt))
    assert built[0].calls == (["start"] if compute_bound else ["prepare", "start"])


def test_each_family_prices_its_own_starts():
    """A draft process's overlapped starts cost a call little; a synchronous draft's start is still priced in
    full, and a family that never started takes the dearest measured ratio."""
    ctl = _controller(compute_bound=False)
    sync, thread = Plan("sync", 4), Plan("ssd", 4, 6, "thread", threads=(1, 1))
    for _ in range(4):
        ctl.record_startup(PROCESS, 400, 0.1 * ctl.startup_model(PROCESS, 400))
        ctl.record_startup(sync, 400, 1.5 * ctl.startup_model(sync, 400))
    assert ctl.startup_s(PROCESS, 400) == pytest.approx(0.1 * ctl.startup_model(PROCESS, 400))
    assert ctl.startup_s(sync, 400) == pytest.approx(1.5 * ctl.startup_model(sync, 400))
    assert ctl.startup_s(thread, 400) == pytest.approx(1.5 * ctl.startup_model(thread, 400))


def test_a_thread_worker_on_its_own_stream_starts_during_the_prefill(pair, monkeypatch):
    """The GPU path's control flow, on a CPU with the CUDA stream calls stubbed: prepare() hands the start to the
    draft's thread (ordered after the caller's stream) and start() returns what that thread made."""

    from hf_ssd.config import SSDConfig
    from hf_ssd.draft.model import DraftModel
    from hf_ssd.draft.saguaro import SaguaroDrafter
    from hf_ssd.workers.thread import ThreadDrafter

    class Stream:
        device = torch.device("cpu")

        def __init__(self):
            self.waited = 0

        def wait_stream(self, other):
            self.waited += 1

    caller = Stream()
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    target, draft, prompts, mask = pair
    inner = SaguaroDrafter(DraftModel(draft, 2, 96, [], True, 1.0, None), SSDConfig(num_draft_tokens=4), SSDStats(),
                           6, True)
    reference = SaguaroDrafter(DraftModel(draft, 2, 96, [], True, 1.0, None), SSDConfig(num_draft_tokens=4),
                               SSDStats(), 6, True).start(prompts, mask)
    drafter = ThreadDrafter(inner, None)
    drafter.stream = Stream()
    started_in: list[str] = []
    start = inner.start

    def recording_start(*args):
        started_in.append(threading.current_thread().name)
        return start(*args)

    monkeypatch.setattr(inner, "start", recording_start)
    try:
        assert drafter.prepare(prompts, mask) is True
        assert drafter.stream.waited == 1  # the draft's stream waits for the prompt on the caller's
        spec = drafter.start(prompts, mask)
    finally:
        drafter.close()
    assert len(started_in) == 1 and started_in[0].startswith("hf-ssd-draft")
    assert torch.equal(spec.tokens, reference.tokens) and torch.equal(spec.n, reference.n)


def test_a_start_that_runs_new_graphs_is_not_priced():
    """A plan's first start on graphs new to this setting runs them for the first time (a draft process's took 232x
    the model on the overhead workload, after compiling): it does not price the family's starts; the next call's
    start, on the same graphs, does (after the family's first start, which Memory leaves out as cold)."""
    ctl = _controller(compute_bound=False)
    ctl.draft_compiled = True
    prompt = torch.zeros(1, 400, dtype=torch.long)
    ratios = []
    for call in range(3):
        drafter = ControlledDrafter(ctl, lambda plan: Recorder(), SSDStats(), Decision(PROCESS, "test", []))
        assert drafter.new_graphs == (call == 0)
        drafter.start(prompt, torch.ones_like(prompt))
        ema = ctl.memory.startup.get("ssd:process")
        ratios.append(None if ema is None else (ema.value, ema.n))
    assert ratios[0] is None  # not recorded: the compiling call
    assert ratios[1] == (None, 0)  # the family's first start: cold, left out
    assert ratios[2][0] is not None and ratios[2][1] == 1
