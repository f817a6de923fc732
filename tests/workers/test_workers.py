"""Every worker kind is exact; draft-side faults lose nothing and leak nothing."""
from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import warnings

import pytest
import torch

import hf_ssd  # noqa: F401
from hf_ssd.workers.process_drafter import ProcessDrafter
from hf_ssd.draft.saguaro import SaguaroDrafter
from hf_ssd.testing import worker_pair
from hf_ssd.workers.thread import live_worker_threads

WORKERS = ["inline", "thread", "process"]
# The SSD engine on each worker (not the controller's choice of mode): K=4, full-precision draft.
SSD = dict(ssd=True, ssd_mode="ssd", ssd_num_draft_tokens=4, ssd_draft_quantize=None)


@pytest.fixture(scope="module")
def pair():
    return worker_pair((3, 9), seed=1, padded={1: 4, 2: 2})


def no_leaks() -> None:
    assert live_worker_threads() == []
    assert [p for p in multiprocessing.active_children() if p.name.startswith("hf-ssd")] == []


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identical_every_worker(pair, worker, batch):
    target, draft, prompts, mask = pair
    ids, m = prompts[:batch], mask[:batch]
    ref = target.generate(ids, attention_mask=m, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, attention_mask=m, max_new_tokens=24, do_sample=False, assistant_model=draft,
                          **SSD, ssd_worker=worker, ssd_budget=6, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.ssd_stats["worker"] == worker
    assert out.ssd_stats["cache_lookups"] > 0
    no_leaks()


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_sampling_matches_inline_with_same_seed(pair, worker):
    """Concurrent workers draw from the draft's own RNG stream, so a seeded run equals the inline run exactly. The
    backup is fixed: the automatic one decides from measured times, which differ between workers."""
    target, draft, prompts, mask = pair
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.9, assistant_model=draft,
              **SSD, ssd_budget=6, ssd_downweight=0.5, ssd_backup="jit")
    inline = target.generate(prompts, generator=torch.Generator().manual_seed(5), ssd_worker="inline", **kw)
    other = target.generate(prompts, generator=torch.Generator().manual_seed(5), ssd_worker=worker, **kw)
    assert torch.equal(inline, other)
    no_leaks()


def test_every_worker_learns_from_every_round(pair):
    """The drafter learns from a round after answering it (the process worker's child once the parent has its
    answer): the same estimates and ranks in every worker, the last round's included (the process reports it at
    the generation's end)."""
    target, draft, prompts, mask = pair
    kw = dict(attention_mask=mask[:1], max_new_tokens=24, do_sample=False, assistant_model=draft, **SSD,
              ssd_budget=6, ssd_backup="ngram", return_dict_in_generate=True)
    learned = ("alpha", "power_r", "fanout_after_hit", "fanout_after_miss", "backup_rounds", "rounds")
    stats = {w: target.generate(prompts[:1], ssd_worker=w, **kw).ssd_stats for w in WORKERS}
    for w in WORKERS:
        assert {n: stats[w][n] for n in learned} == {n: stats["inline"][n] for n in learned}, w
    no_leaks()


class Boom(RuntimeError):
    pass


def _fail_at(monkeypatch, method: str, at_round: int):
    original = getattr(SaguaroDrafter, method)
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_round:
            raise Boom(f"injected failure in {method} #{at_round}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SaguaroDrafter, method, flaky)
    return calls


@pytest.mark.parametrize("worker", ["inline", "thread"])
@pytest.mark.parametrize("method,at_round", [("start", 1), ("begin", 1), ("begin", 4), ("resolve", 3), ("begin", 10**6)])
def test_draft_fault_loses_nothing(pair, monkeypatch, worker, method, at_round):
    target, draft, prompts, mask = pair
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False)
    calls = _fail_at(monkeypatch, method, at_round)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(prompts, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=draft,
                              **SSD, ssd_worker=worker, ssd_budget=6, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    injected = calls["n"] >= at_round
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("injected failure" in m for m in messages) == injected
    assert (out.ssd_stats["fallback_reason"] is not None) == injected
    no_leaks()


def test_fault_in_last_round(pair, monkeypatch):
    """A failure while the final round is verified: the round's tokens still land."""
    target, draft, prompts, mask = pair
    ref = target.generate(prompts[:1], attention_mask=mask[:1], max_new_tokens=20, do_sample=False)
    probe = target.generate(prompts[:1], attention_mask=mask[:1], max_new_tokens=20, do_sample=False,
                            assistant_model=draft, **SSD, ssd_worker="thread", ssd_budget=6, ssd_backup="ngram",
                            return_dict_in_generate=True)
    last = probe.ssd_stats["rounds"]  # the same rounds below: the backup is fixed (the measured choice could differ)
    calls = _fail_at(monkeypatch, "begin", last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(prompts[:1], attention_mask=mask[:1], max_new_tokens=20, do_sample=False,
                              assistant_model=draft, **SSD, ssd_worker="thread", ssd_budget=6, ssd_backup="ngram")
    assert torch.equal(out, ref)
    # The last build may be cancelled before it starts (nobody needs it); if it ran and failed, we were told.
    warned = any("injected failure" in str(w.message) for w in caught)
    assert warned == (calls["n"] >= last)
    no_leaks()


def _at_process_begin(monkeypatch, at_round: int, action) -> None:
    """Run `action(drafter, spec)` at the `at_round`-th ProcessDrafter.begin; it returns True to skip the real one."""
    original = ProcessDrafter.begin
    calls = {"n": 0}

    def patched(self, spec):
        calls["n"] += 1
        if calls["n"] == at_round and action(self, spec):
            return None
        return original(self, spec)

    monkeypatch.setattr(ProcessDrafter, "begin", patched)


@pytest.mark.parametrize("at_round", [1, 3])
def test_killed_process_worker_loses_nothing(pair, monkeypatch, at_round):
    target, draft, prompts, mask = pair
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False)
    def kill(drafter, spec):
        os.kill(drafter.worker.process.pid, signal.SIGKILL)
        drafter.worker.process.join(timeout=10)
        return False  # then run the real begin on the dead process

    _at_process_begin(monkeypatch, at_round, kill)
    _falls_back_exactly(pair, ref, "draft process died")


def test_process_worker_error_reported(pair, monkeypatch):
    """An exception inside the child (here: a malformed command) comes back as a fallback with its traceback."""
    target, draft, prompts, mask = pair
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False)
    def poison(drafter, spec):
        drafter.worker.send("begin", "not a speculation")
        return True  # replaces the real begin

    _at_process_begin(monkeypatch, 2, poison)
    _falls_back_exactly(pair, ref, "draft process failed")


def _falls_back_exactly(pair, ref, warning: str) -> None:
    """A process-worker generation whose fault was injected: it warns, keeps every token, leaks nothing."""
    target, draft, prompts, mask = pair
    with pytest.warns(RuntimeWarning, match=warning):
        out = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant_model=draft,
                              **SSD, ssd_worker="process", ssd_budget=6)
    assert torch.equal(out, ref)
    no_leaks()


def test_draft_model_broken_falls_back_to_plain(pair, monkeypatch):
    """If even the synchronous drafter fails, the engine finishes with plain target steps."""
    target, draft, prompts, mask = pair
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False)
    from hf_ssd.draft import model as draft_module

    def broken(self, *a, **k):
        raise Boom("draft model unusable")

    monkeypatch.setattr(draft_module.DraftModel, "jit", broken)
    with pytest.warns(RuntimeWarning, match="draft model unusable"):
        out = target.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft,
                              **SSD, ssd_worker="inline", return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.ssd_stats["fallback_reason"] is not None


def test_persistent_process_worker_reused(pair):
    """A kept DraftProcess serves several generate() calls (no start-up each time) and ends with its context."""
    target, draft, prompts, mask = pair
    with hf_ssd.DraftProcess(draft) as worker:
        pid = worker.process.pid
        for batch in (1, 3):
            ref = target.generate(prompts[:batch], attention_mask=mask[:batch], max_new_tokens=16, do_sample=False)
            out = target.generate(prompts[:batch], attention_mask=mask[:batch], max_new_tokens=16, do_sample=False,
                                  assistant_model=draft, **SSD, ssd_worker=worker, ssd_budget=6,
                                  return_dict_in_generate=True)
            assert torch.equal(out.sequences, ref)
            assert out.ssd_stats["worker"] == "process" and out.ssd_stats["cache_lookups"] > 0
            assert worker.process.is_alive() and worker.process.pid == pid
    assert not worker.process.is_alive()
    no_leaks()


def test_persistent_process_worker_dead_falls_back(pair):
    target, draft, prompts, mask = pair
    worker = hf_ssd.DraftProcess(draft)
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.join(timeout=10)
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False)
    with pytest.warns(RuntimeWarning, match="died"):
        out = target.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft,
                              **SSD, ssd_worker=worker)
    assert torch.equal(out, ref)
    worker.close()
    no_leaks()


def test_persistent_worker_for_other_draft_is_refused(pair):
    target, draft, prompts, mask = pair
    other = type(draft)(draft.config).eval()
    with hf_ssd.DraftProcess(other) as worker:
        with pytest.raises(ValueError, match="different draft model"):
            target.generate(prompts, attention_mask=mask, max_new_tokens=4, assistant_model=draft, **SSD,
                            ssd_worker=worker)


class InterruptAt:
    """A stopping criterion that raises KeyboardInterrupt once the sequence reaches a length (a user's Ctrl-C)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[-1] >= self.length:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("worker", WORKERS)
def test_keyboard_interrupt_stops_cleanly(pair, worker):
    from transformers import StoppingCriteriaList

    target, draft, prompts, mask = pair
    with pytest.raises(KeyboardInterrupt):
        target.generate(prompts, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant_model=draft,
                        **SSD, ssd_worker=worker, ssd_budget=6,
                        stopping_criteria=StoppingCriteriaList([InterruptAt(prompts.shape[1] + 10)]))
    no_leaks()
    # and the next call works normally
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = target.generate(prompts, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant_model=draft,
                          **SSD, ssd_worker=worker, ssd_budget=6)
    assert torch.equal(out, ref)


# ---- the process worker's per-round hand-over: fixed shared buffers, small messages ---------------------------------
def _tensors_in(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, (list, tuple)):
        return sum(_tensors_in(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensors_in(o) for o in obj.values())
    return 0


class RecordingConn:
    """The parent's end of the pipe, recording every request and answer."""

    def __init__(self, conn):
        self.conn, self.sent, self.received = conn, [], []

    def send(self, msg):
        self.sent.append(msg)
        return self.conn.send(msg)

    def recv(self):
        msg = self.conn.recv()
        self.received.append(msg)
        return msg

    def __getattr__(self, name):
        return getattr(self.conn, name)


@pytest.mark.parametrize("sample", [False, True])
def test_process_rounds_send_no_tensors(pair, monkeypatch, sample):
    """After a generation's start, begin/resolve put only small control messages on the pipe: the speculations,
    outcomes, contexts and q travel through the buffers allocated once per generation. A tiny context capacity
    makes the contexts buffer grow (sent again, once per growth); the n-gram backup reads the contexts from it."""
    import pickle

    from hf_ssd.workers import process_drafter as process_module

    target, draft, prompts, mask = pair
    monkeypatch.setattr(process_module, "CONTEXT_CAPACITY", 4)
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=sample, assistant_model=draft, **SSD, ssd_budget=6,
              ssd_backup="ngram", return_dict_in_generate=True)
    if sample:
        kw.update(temperature=0.9, ssd_downweight=0.5)
    seeded = (lambda: dict(generator=torch.Generator().manual_seed(7))) if sample else dict
    inline = target.generate(prompts, ssd_worker="inline", **seeded(), **kw)
    with hf_ssd.DraftProcess(draft) as worker:
        real = worker.conn
        worker.conn = RecordingConn(real)
        try:
            out = target.generate(prompts, ssd_worker=worker, **seeded(), **kw)
        finally:
            sent, received, worker.conn = worker.conn.sent, worker.conn.received, real
    assert torch.equal(out.sequences, inline.sequences)
    for key in ("rounds", "accept_hist", "cache_hits", "cache_lookups", "backup_rounds"):
        assert out.ssd_stats[key] == inline.ssd_stats[key], key
    commands = [m[1] for m in sent]
    assert commands.count("exchange") == 1 and commands.count("start") == 1
    assert commands.count("resolve") == out.ssd_stats["rounds"] - 1 and commands.count("begin") == out.ssd_stats["rounds"]
    assert 1 <= commands.count("contexts") <= 3  # 18 -> 36 slots: the longest row reaches 9 + 24 + K tokens
    with_tensors = {m[1] for m in sent if _tensors_in(m)}
    assert with_tensors <= {"setup", "start", "exchange", "contexts"}, with_tensors
    per_round = [m for m in sent if m[1] in ("begin", "resolve")]
    assert max(len(pickle.dumps(m)) for m in per_round) < 100
    answers = {m[0]: m for m in received}
    resolves = [answers[m[0]] for m in sent if m[1] == "resolve"]
    assert len(resolves) == commands.count("resolve")
    assert all(_tensors_in(a) == 0 for a in resolves)
    assert max(len(pickle.dumps(a)) for a in resolves) < 2000
    no_leaks()


@pytest.mark.parametrize("worker", WORKERS)
def test_handover_in_phase_means(pair, worker):
    """The process and thread workers report how much of resolve was the hand-over; inline has none."""
    target, draft, prompts, mask = pair
    out = target.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft,
                          **SSD, ssd_worker=worker, ssd_budget=6, return_dict_in_generate=True)
    phases = out.ssd_stats["phase_means_s"]
    if worker == "inline":
        assert "handover" not in phases
    else:
        assert 0.0 <= phases["handover"] <= phases["resolve"] + 1e-3
    no_leaks()


def _open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/<pid>/fd")
def test_kept_process_fds_flat_over_generations(pair):
    """The per-generation buffers are freed with the generation, in the parent and in the child."""
    target, draft, prompts, mask = pair

    def generation(i: int) -> None:
        batch = 1 + i % 3
        kw = dict(do_sample=True, temperature=0.9, generator=torch.Generator().manual_seed(i)) if i % 2 else {}
        target.generate(prompts[:batch], attention_mask=mask[:batch], max_new_tokens=8, assistant_model=draft,
                        **SSD, ssd_worker=worker, ssd_budget=6, **kw)

    with hf_ssd.DraftProcess(draft) as worker:
        for i in range(4):
            generation(i)
        parent, child = _open_fds(), _open_fds(worker.process.pid)
        for i in range(50):
            generation(i)
        assert _open_fds() <= parent + 2
        assert _open_fds(worker.process.pid) <= child + 2
    no_leaks()


class CutAtBegin(RecordingConn):
    """Ctrl-C in the middle of writing the first `begin` (the pipe is left mid-message: the next generation
    restarts the child)."""

    def send(self, msg):
        if msg[1] == "begin":
            self.conn._send(struct.pack("!i", 4096) + b"\x80\x05partial")
            raise KeyboardInterrupt
        return super().send(msg)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/<pid>/fd")
def test_restart_right_after_the_exchange_leaks_no_fds(pair):
    """The buffers travel as file descriptors the child fetches while unpickling; the exchange is answered, so a
    child restarted right after it (here: a request cut mid-write) has fetched them all: none is left behind in
    the parent (an unanswered exchange leaked them, and the parent printed ConnectionResetError)."""
    target, draft, prompts, mask = pair
    ids, m = prompts[:2], mask[:2]
    ref = target.generate(ids, attention_mask=m, max_new_tokens=8, do_sample=False)
    with hf_ssd.DraftProcess(draft) as worker:
        before = _open_fds()
        for _ in range(3):
            real = worker.conn
            worker.conn = CutAtBegin(real)
            try:
                with pytest.raises(KeyboardInterrupt):
                    target.generate(ids, attention_mask=m, max_new_tokens=8, do_sample=True, assistant_model=draft,
                                    **SSD, ssd_worker=worker, ssd_budget=6)
            finally:
                worker.conn = real
            out = target.generate(ids, attention_mask=m, max_new_tokens=8, do_sample=False, assistant_model=draft,
                                  **SSD, ssd_worker=worker, ssd_budget=6)  # restarts the child first
            assert torch.equal(out, ref)
        assert worker.restarts == 3
        assert _open_fds() <= before + 1
    no_leaks()
