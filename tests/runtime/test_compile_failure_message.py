"""A failed compile of a static-cache forward is reported with what dynamo says it could not trace, and where."""
from __future__ import annotations

import torch

from hf_ssd.runtime.static_kv import _what_failed


def test_a_graph_break_is_reported_with_its_context_and_our_line():
    def step(x, generator):
        return torch.randn(3, generator=generator) + x  # a Generator argument: dynamo cannot proxy it

    try:
        torch.compile(step, fullgraph=True)(torch.ones(3), torch.Generator())
    except Exception as exc:  # noqa: BLE001 - whatever dynamo raises, its message is what is reported
        message = str(exc)
    else:
        raise AssertionError("expected the compile to fail on the Generator argument")
    torch._dynamo.reset()
    said = _what_failed(message)
    assert said.startswith(message.strip().splitlines()[0])
    assert "context:" in message or 'File "' in message, "dynamo no longer says what or where: update _what_failed"
    if "context:" in message:  # torch versions that give dynamo's debug context
        assert "Generator" in said
    if 'File "' in message:
        assert "test_compile_failure_message.py" in said and "randn" in said


def test_a_plain_message_is_kept_to_its_first_line():
    assert _what_failed("RuntimeError: boom\n\n  more\n") == "RuntimeError: boom"
