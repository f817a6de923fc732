"""Device time, not launch time: on CUDA a span is read from events once the work is done; the verify's and the
draft's spans are what the backup policy and the controller's cost lines learn from."""
from __future__ import annotations

import pytest
import torch

from hf_ssd.core.device_span import DeviceSpan
from hf_ssd.testing import get_pair, left_pad, plain_generate, prompt


class FakeEvent:
    """A CUDA event on a fake device clock (`now`): the host returns from launches at once, the device runs later."""

    now = 0.0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at, self.synced = None, False

    def record(self, stream=None):
        assert stream == "stream of cuda:1", stream  # the work's device's stream, not the current device's
        self.at = FakeEvent.now

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert end.synced, "read before the end event was waited for"
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


def test_a_cuda_span_is_the_devices_time_read_after_its_end_event(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    FakeEvent.now = 10.0
    span = DeviceSpan("cuda:1")
    FakeEvent.now = 10.25  # the queued work ran on the device
    span.stop()
    assert span.cuda and span.seconds() == pytest.approx(0.25)


def test_a_cpu_span_is_the_host_clock():
    span = DeviceSpan("cpu")
    assert not span.cuda
    with pytest.raises(RuntimeError):
        span.seconds()
    assert 0.0 <= span.stop().seconds() < 1.0


class FixedSpan:
    """A span that says every stretch took SECONDS on its device (as CUDA events would, whatever the host saw)."""

    SECONDS = 0.125
    cuda = True

    def __init__(self, device):
        pass

    def stop(self):
        return self

    def seconds(self) -> float:
        return self.SECONDS


@pytest.mark.parametrize("mode", ["ssd", "ssd static", "sync", "sync static"])
def test_verify_and_draft_are_learned_from_the_device_span(monkeypatch, mode):
    """Swap the span for one that reports a fixed device time: the controller's verify and draft lines, the backup
    and the round timeline's verify phase hold it, not the host's clock."""
    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.control import memory as memory_mod
    from hf_ssd.control.plan import Plan
    from hf_ssd.draft import saguaro, static_saguaro, sync
    from hf_ssd.runtime import engine, static_kv

    for module in (engine, saguaro, static_saguaro, sync):
        monkeypatch.setattr(module, "DeviceSpan", FixedSpan)
    monkeypatch.setattr(memory_mod, "_MEMORY", {})
    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)  # the static caches, run eagerly (fast)
    plan = Plan("ssd", 2, 6, "thread") if mode.startswith("ssd") else Plan("sync", 3)
    static = {"ssd_compile": True, "ssd_compile_target": True} if mode.endswith("static") else {}
    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None: ctl_mod.Decision(
        plan, "test: fixed", []))
    pair = get_pair("llama")
    ids, mask = left_pad([prompt(7, seed=3)[0]])
    ref = plain_generate(pair.target, ids, attention_mask=mask, max_new_tokens=24)
    out = pair.target.generate(ids, attention_mask=mask, assistant_model=pair.related, ssd=True, max_new_tokens=24,
                               do_sample=False, pad_token_id=0, ssd_backup="ngram", return_dict_in_generate=True, **static)
    assert out.ssd_stats["fallback_reason"] is None and bool(out.ssd_stats["draft_static"]) == bool(static)
    assert torch.equal(out.sequences, ref)
    (memory,) = memory_mod._MEMORY.values()
    for key, line in memory.lines.items():
        assert line.points, key
        for at, ema in line.points.items():
            assert ema.value == pytest.approx(FixedSpan.SECONDS), (key, at)
    kinds = {key[0] for key in memory.lines}
    assert kinds == {"draft", "verify"}
    assert out.ssd_stats["phase_means_s"]["verify"] == pytest.approx(FixedSpan.SECONDS)

