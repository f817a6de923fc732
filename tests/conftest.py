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
