"""custom_generate repo written from the package: loaded from a local dir, output identical to ssd=True."""
from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import GenerationMixin

import hf_ssd
from hf_ssd import SSDConfig
from hf_ssd.hf.custom_generate_repo import write_custom_generate_repo
from hf_ssd.testing import tiny_pair


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return str(write_custom_generate_repo(tmp_path_factory.mktemp("cg") / "repo", SSDConfig(num_draft_tokens=3)))


@contextlib.contextmanager
def stock_transformers():
    """As for a user who never imports hf_ssd (with hf_ssd enabled, its wrapper refuses ssd_* without ssd=True)."""
    hf_ssd.disable()
    try:
        yield
    finally:
        hf_ssd.enable()


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


def test_layout(repo):
    from pathlib import Path

    root = Path(repo)
    assert (root / "custom_generate" / "generate.py").is_file()
    reqs = (root / "custom_generate" / "requirements.txt").read_text().split()
    assert any(r.startswith("hf-ssd") for r in reqs)
    assert SSDConfig.from_pretrained(root).num_draft_tokens == 3


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_identical_to_ssd_true(repo, models, batch):
    target, draft, tok = models
    enc = tok(["def add(a, b):", "x = "][:batch], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, ssd_mode="ssd")
    ref = target.generate(**enc, assistant_model=draft, ssd=True, **kw)
    hf_ssd.disable()  # a user who never enabled hf_ssd
    try:
        stock = GenerationMixin.generate
        out = target.generate(**enc, custom_generate=repo, trust_remote_code=True, assistant_model=draft, **kw)
        assert GenerationMixin.generate is stock  # loading the repo did not patch transformers
    finally:
        hf_ssd.enable()
    assert torch.equal(out.sequences, ref.sequences)
    assert out.ssd_stats["mode"] == "ssd"
    plain = target.generate(**enc, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.sequences, plain)


def test_sampling_and_options_pass_through(repo, models):
    target, draft, tok = models
    enc = tok("hello", return_tensors="pt")
    # a whole plan (K and precision fixed): a controller choosing from timings could pick another K in one call
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.8, return_dict_in_generate=True, ssd_mode="sync",
              ssd_num_draft_tokens=3, ssd_draft_quantize=None)
    ref = target.generate(**enc, assistant_model=draft, ssd=True, generator=torch.Generator().manual_seed(3), **kw)
    with stock_transformers():
        out = target.generate(**enc, custom_generate=repo, trust_remote_code=True, assistant_model=draft,
                              generator=torch.Generator().manual_seed(3), **kw)
    assert out.ssd_stats["mode"] == "sync" and out.ssd_stats["controller"] is None is ref.ssd_stats["controller"]
    assert torch.equal(out.sequences, ref.sequences)


def test_streamer_reaches_ssd(repo, models):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens += value.flatten().tolist()

        def end(self):
            self.ended = True

    target, draft, tok = models
    enc = tok("abc", return_tensors="pt")
    s = Collect()
    out = target.generate(**enc, custom_generate=repo, trust_remote_code=True, assistant_model=draft, streamer=s,
                          max_new_tokens=10, do_sample=False)
    assert s.ended and s.tokens == out[0].tolist()


def test_needs_trust_remote_code_and_draft(repo, models):
    target, draft, tok = models
    enc = tok("abc", return_tensors="pt")
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(**enc, custom_generate=repo, assistant_model=draft, max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a draft model"):
        target.generate(**enc, custom_generate=repo, trust_remote_code=True, max_new_tokens=4)
