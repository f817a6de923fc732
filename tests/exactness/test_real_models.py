"""Greedy identity on real pretrained weights (fp32): SmolLM2-135M against a perturbed copy of itself, and the
default Qwen2.5-Coder 1.5B/0.5B pair when its packages are installed (scripts/setup.sh --models)."""
from __future__ import annotations

import copy

import pytest
import torch

import hf_ssd  # noqa: F401
from hf_ssd.tools import assets


def _need(name: str) -> None:
    if not assets.pair_available(name):
        pytest.skip(f"{name} assets not installed: {assets.missing_packages(name)} (see requirements/)")


@pytest.fixture(scope="module")
def smollm2_pair():
    _need("smollm2")
    target, tok = assets.load_model("smollm2")
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a perturbed copy: agrees often, not always
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.15)
    return target, draft, tok


@pytest.mark.slow
@pytest.mark.parametrize("mode,worker", [("sync", "inline"), ("ssd", "inline"), ("ssd", "thread")])
def test_smollm2_greedy_identical(smollm2_pair, mode, worker):
    target, draft, tok = smollm2_pair
    enc = tok(["def is_prime(n):\n    ", "The capital of France is"], return_tensors="pt", padding=True,
              padding_side="left")
    ref = target.generate(**enc, max_new_tokens=24, do_sample=False)
    out = target.generate(**enc, max_new_tokens=24, do_sample=False, assistant_model=draft, ssd=True, ssd_mode=mode,
                          ssd_worker=worker, ssd_budget=8, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.ssd_stats["accepted"] > 0


@pytest.mark.slow
def test_default_pair_greedy_identical():
    _need("default")
    target, draft, tok = assets.load_default_pair()
    enc = tok("def fibonacci(n):", return_tensors="pt")
    ref = target.generate(**enc, max_new_tokens=12, do_sample=False)
    out = target.generate(**enc, max_new_tokens=12, do_sample=False, assistant_model=draft, ssd=True, ssd_mode="ssd",
                          ssd_num_draft_tokens=4, ssd_budget=6, ssd_draft_quantize=None,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.ssd_stats["mean_accepted"] > 1.0
