"""Pytest fixtures over hf_ssd.testing (tiny random models from configs, toy tokenizers, left padding): the helpers
themselves live there, once, so examples and the bench use the same ones."""
from __future__ import annotations

import os

import pytest
import torch

# No kept draft process is started behind a test's back (workers.pool); the tests of the pool turn it on themselves.
os.environ.setdefault("HF_SSD_AUTO_PROCESS", "0")

import hf_ssd  # noqa: F401  (enables generate(..., ssd=True))
from hf_ssd.testing import ARCHS, Pair, get_pair

torch.set_num_threads(1)  # tiny models: one intra-op thread is fastest and keeps timings stable on 2 shared cores


@pytest.fixture(params=ARCHS)
def pair(request) -> Pair:
    return get_pair(request.param)


@pytest.fixture
def llama() -> Pair:
    return get_pair("llama")


@pytest.fixture
def pack_everything(monkeypatch) -> dict:
    """Every float32 Linear is packed for the packed few-row kernel (the tiny test models' weights are far below its
    size threshold), what the test packs is forgotten after it, and the kernel's calls are counted (["n"]). Skips
    where the kernel cannot build or run."""
    import weakref

    from hf_ssd.kernels import packed_linear as pl

    if pl.unavailable_reason() is not None:
        pytest.skip(f"packed kernel unavailable here: {pl.unavailable_reason()}")
    monkeypatch.setattr(pl, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(pl, "_MODELS", weakref.WeakKeyDictionary())
    calls = {"n": 0}
    kernel = pl.packed_linear

    def counted(*args, **kwargs):
        calls["n"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(pl, "packed_linear", counted)
    return calls
