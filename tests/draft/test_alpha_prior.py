"""A call's first tree is planned from the α measured so far, not from the prior: with the target as its own draft
(α = 1) a K = 8 tree planned at the prior α = 0.7 gives "all 8 accepted" no branch (0.7^8 = 6%), so the first
lookup of every call missed."""
from __future__ import annotations

import pytest
import torch

from hf_ssd.testing import get_pair, left_pad, plain_generate, prompt

K, BUDGET = 8, 2


def _twin(model):
    """A fresh model with `model`'s weights (α = 1 as a draft). Not the shared test model itself: other tests may
    leave attributes on it (a compiled call) that a draft process cannot be sent."""
    twin = type(model)(model.config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def _generate(p, ids, mask, **kw):
    draft = _DRAFTS.setdefault(id(p.target), _twin(p.target))
    return p.target.generate(ids, attention_mask=mask, assistant_model=draft, ssd=True, max_new_tokens=40,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True, **kw)


_DRAFTS: dict = {}


@pytest.mark.parametrize("worker", ["inline", "process"])
def test_a_tree_planned_from_a_high_alpha_hits_from_the_first_round(worker):
    p = get_pair("llama")
    ids, mask = left_pad([prompt(7, seed=3)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=40)
    fixed = dict(ssd_mode="ssd", ssd_worker=worker, ssd_num_draft_tokens=K, ssd_budget=BUDGET, ssd_draft_quantize=None)
    cold = _generate(p, ids, mask, **fixed)
    warm = _generate(p, ids, mask, **fixed, ssd_alpha_prior=0.99)
    assert torch.equal(cold.sequences, ref) and torch.equal(warm.sequences, ref)
    assert cold.ssd_stats["fallback_reason"] is None and warm.ssd_stats["fallback_reason"] is None
    lookups = warm.ssd_stats["cache_lookups"]
    assert lookups >= 3 and cold.ssd_stats["cache_hits"] == lookups - 1  # the first round, planned at 0.7
    assert warm.ssd_stats["cache_hits"] == lookups and warm.ssd_stats["backup_rounds"].get("jit", 0) == 0


def test_ssd_true_plans_each_calls_first_tree_from_the_measured_alpha(monkeypatch):
    """ssd=True hands its SSD plans the α it measured (after a call has drafted): the second call's first lookup
    hits where the first call's missed."""
    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.control import memory as memory_mod
    from hf_ssd.control.plan import Plan

    monkeypatch.setattr(memory_mod, "_MEMORY", {})
    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None: ctl_mod.Decision(
        Plan("ssd", K, BUDGET, "thread"), "test: fixed", []))
    p = get_pair("llama")
    ids, mask = left_pad([prompt(7, seed=3)[0]])
    first, second = (_generate(p, ids, mask) for _ in range(2))
    assert first.ssd_stats["cache_hits"] == first.ssd_stats["cache_lookups"] - 1
    assert second.ssd_stats["cache_hits"] == second.ssd_stats["cache_lookups"] >= 3
