"""An int8 draft is never compiled: torch.ao's dynamic int8 Linears cannot be traced, so asking for both runs the
int8 draft eagerly with one clear warning (no failed compile per width), keeps the output exact, and the
controller charges no compile to an int8 plan's draft."""
from __future__ import annotations

import warnings

import pytest
import torch

from hf_ssd.control.compiled import plan_graphs
from hf_ssd.control.plan import Plan
from hf_ssd.draft.quant import quantized_draft
from hf_ssd.runtime.static_choice import compilable, static_draft_cache, static_target_cache
from hf_ssd.testing import plain_generate, prompt, ssd_generate, tiny_pair


@pytest.fixture(scope="module")
def pair():
    target, draft, _ = tiny_pair()
    return target, draft


def test_an_int8_copy_is_not_compilable_and_the_float_draft_is(pair):
    target, draft = pair
    assert compilable(draft) and compilable(target)
    assert not compilable(quantized_draft(draft, "int8"))


def test_static_caches_refuse_an_int8_model_saying_why(pair):
    _, draft = pair
    int8 = quantized_draft(draft, "int8")

    class Asked:
        compile = True

    with pytest.warns(RuntimeWarning, match="int8 draft runs eagerly.*ssd_draft_quantize=None"):
        assert static_draft_cache(int8, Asked(), 1, 64, 2, 4, draft.config.vocab_size) is None
    Asked.compile = "auto"  # the controller's own choice: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert static_draft_cache(int8, Asked(), 1, 64, 2, 4, draft.config.vocab_size) is None
    with pytest.warns(RuntimeWarning, match="verifies eagerly"):
        assert static_target_cache(int8, 1, 64) is None


def exact_saying(pair, **options) -> list[str]:
    """What hf_ssd warned while generating 16 tokens with `options` (the output checked against plain generate())."""
    target, draft = pair
    ids = prompt(12).reshape(1, -1)
    want = plain_generate(target, ids, max_new_tokens=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ssd_generate(target, draft, ids, max_new_tokens=16, ssd_compile=True, **options)
    assert torch.equal(got, want)
    return [str(w.message) for w in caught if "hf_ssd" in str(w.message)]


def test_compile_with_an_int8_draft_is_exact_and_warns_once_without_failed_compiles(pair):
    said = exact_saying(pair, ssd_mode="sync", ssd_num_draft_tokens=3, ssd_draft_quantize="int8")
    assert not any("failed" in m for m in said), said
    assert sum("int8 draft runs eagerly" in m for m in said) == 1, said


def test_an_int8_plan_has_no_draft_graphs_to_compile():
    for mode, K, budget in (("sync", 3, 0), ("ssd", 3, 8)):
        float_graphs = plan_graphs(Plan(mode, K, budget), draft=True, target=True, max_length=200)
        int8_graphs = plan_graphs(Plan(mode, K, budget, int8=True), draft=True, target=True, max_length=200)
        assert any(g[0] == "draft" for g in float_graphs)
        assert [g for g in int8_graphs if g[0] == "draft"] == []
        assert {g for g in int8_graphs if g[0] == "target"} == {g for g in float_graphs if g[0] == "target"}


def test_compile_with_an_int8_plan_the_controller_chose_warns_nothing(pair, monkeypatch):
    """ssd_compile=True and no ssd_draft_quantize: where the controller runs its int8 copy of the draft (which it
    charges no compile), nothing tells the user to change an option they did not set."""
    from hf_ssd.control import controller as ctl_mod

    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None: ctl_mod.Decision(
        Plan("sync", 3, int8=True), "test: int8", []))
    said = exact_saying(pair, ssd_mode="auto", ssd_num_draft_tokens=None, ssd_budget=None)
    assert not [m for m in said if "int8 draft runs eagerly" in m], said
