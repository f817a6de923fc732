"""A drafter elsewhere (a draft process, a draft thread) gets the round's outcome before the controller's bookkeeping
(Drafter.send), so that work overlaps the draft side's lookup instead of delaying it. The output stays plain
generate()'s, and the caller's own work between send and resolve is not counted as hand-over."""
from __future__ import annotations

import time

import pytest
import torch

import hf_ssd  # noqa: F401
from hf_ssd.control.controller import Controller
from hf_ssd.testing import worker_pair
from hf_ssd.workers.process_drafter import ProcessDrafter
from hf_ssd.workers.thread import ThreadDrafter

# every option but the int8 draft: the controller runs (a fully spelled-out plan runs without it)
SSD = dict(ssd=True, ssd_mode="ssd", ssd_num_draft_tokens=3, ssd_budget=6, ssd_target_threads=1, ssd_draft_threads=1)
SENDERS = {"process": ProcessDrafter, "thread": ThreadDrafter}


@pytest.fixture(scope="module")
def pair():
    return worker_pair((2, 11), seed=5, padded={0: 2})


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_the_outcome_reaches_the_draft_side_before_the_controllers_bookkeeping(pair, worker, monkeypatch):
    target, draft, prompts, mask = pair
    ref = target.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False)
    events: list[str] = []
    sender = SENDERS[worker]
    send, observe = sender.send, Controller.observe_acceptance

    def recording_send(self, verdict):
        events.append("send")
        return send(self, verdict)

    def slow_observe(self, *args, **kwargs):
        events.append("observe")
        time.sleep(0.03)  # the caller's own work: not the hand-over's
        return observe(self, *args, **kwargs)

    monkeypatch.setattr(sender, "send", recording_send)
    monkeypatch.setattr(Controller, "observe_acceptance", slow_observe)
    out = target.generate(prompts, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant_model=draft,
                          return_dict_in_generate=True, ssd_worker=worker, **SSD)
    assert torch.equal(out.sequences, ref)
    stats = out.ssd_stats
    assert stats["controller"] is not None and not stats.get("fallback_reason")
    rounds = events.count("observe")
    assert rounds == stats["rounds"] - 1  # the first verify's outcome comes with no round before it
    # each round's outcome went out before its bookkeeping, but in rounds where a decision was due (it may switch
    # the drafter, so it comes first)
    sent_first = sum(a == "send" and b == "observe" for a, b in zip(events, events[1:]))
    assert sent_first == events.count("send") >= rounds // 2
    assert stats["phase_means_s"]["handover"] < 0.015  # the 30 ms of bookkeeping a round are not in it
