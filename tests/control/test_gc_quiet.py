"""Decisions run with Python's garbage collector held off (control.gc_quiet): their thousands of temporaries die by
reference count, and did set off collections (0.3-3 ms each beside a compiled model's heap) inside the rounds."""
from __future__ import annotations

import gc

import pytest

from hf_ssd.control.controller import Controller
from hf_ssd.control.gc_quiet import collections_paused
from hf_ssd.control.memory import Memory
from hf_ssd.control.plan import Plan

from tests.control.test_controller import costs


@pytest.fixture
def collections():
    """The collections that run, under a young-generation threshold low enough that a decision would set one off."""
    ran: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            ran.append(info["generation"])

    threshold, was_enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    gc.enable()
    gc.set_threshold(50, *threshold[1:])
    gc.callbacks.append(seen)
    try:
        yield ran
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
        if not was_enabled:
            gc.disable()


def test_no_collection_runs_while_a_decision_or_a_process_question_prices_plans(collections, monkeypatch):
    ctl = Controller(costs(), Memory(), 4, {}, fixed_alpha=0.8)
    ctl.memory.record_round(Plan("sync", 2), 0.05, count=8)
    during: list[int] = []  # collections seen while predictions were made
    predict = ctl.predict

    def watched(*args, **kwargs):
        before = len(collections)
        try:
            return predict(*args, **kwargs)
        finally:
            during.append(len(collections) - before)

    monkeypatch.setattr(ctl, "predict", watched)
    ctl.decide()
    ctl.process_option(Plan("sync", 2))
    assert len(during) > 100 and sum(during) == 0
    monkeypatch.setattr(ctl, "decide", Controller.decide.__wrapped__.__get__(ctl))  # the same decision, unpaused
    ctl.decide()
    assert sum(during) > 0


def test_the_callers_setting_comes_back():
    was_enabled = gc.isenabled()
    try:
        gc.enable()
        with collections_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()  # a caller that runs without the collector keeps it off
        with collections_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
        with pytest.raises(RuntimeError):
            with collections_paused():
                raise RuntimeError("a failing decision")
        assert not gc.isenabled()
    finally:
        (gc.enable if was_enabled else gc.disable)()
