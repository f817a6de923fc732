"""Fixtures shared by the draft-side tests."""
from __future__ import annotations

import pytest
import torch

SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every Python-level read of a tensor's values on the host while `counting` is set."""
    calls: list[str] = []
    state = {"on": False}
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def patched(self, *args, _name=name, _original=original, **kwargs):
            if state["on"]:
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, patched)
    original_nonzero = torch.nonzero

    def nonzero(*args, **kwargs):
        if state["on"]:
            calls.append("torch.nonzero")
        return original_nonzero(*args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", nonzero)
    return calls, state
