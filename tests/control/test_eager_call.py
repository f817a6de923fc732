"""A compiled setting's call whose chosen plan would have to compile runs eagerly when the eager plans are predicted
faster over the call (session.eager_call): it learns in the eager setting's memory, and its output is plain's."""
from __future__ import annotations

import torch

from hf_ssd.control import memory as memory_mod
from hf_ssd.control.controller import Controller
from hf_ssd.testing import get_pair, left_pad, plain_generate, prompt

COMPILED = dict(ssd=True, ssd_compile=True, ssd_compile_target=True, max_new_tokens=16, do_sample=False,
                pad_token_id=0, return_dict_in_generate=True)


def _compiles_cost(monkeypatch, seconds: float) -> None:
    """Every plan with compiled graphs is priced `seconds` of compiling this call (eager plans have none)."""
    monkeypatch.setattr(Controller, "compile_s",
                        lambda self, plan, horizon, in_loop: seconds if self.graphs(plan, in_loop) else 0.0)


def _memories() -> dict[bool, memory_mod.Memory]:
    """The settings' memories by whether they are compiled (the key's compile options)."""
    return {bool(key[5] or key[6]): memory for key, memory in memory_mod._MEMORY.items()}


def test_a_call_whose_compiled_plans_would_compile_runs_eagerly(monkeypatch):
    monkeypatch.setattr(memory_mod, "_MEMORY", {})
    _compiles_cost(monkeypatch, 100.0)
    pair = get_pair("llama")
    ids, mask = left_pad([prompt(9, seed=41)[0]])
    ref = plain_generate(pair.target, ids, attention_mask=mask, max_new_tokens=16)
    out = pair.target.generate(ids, attention_mask=mask, assistant_model=pair.related, **COMPILED)
    assert torch.equal(out.sequences, ref)
    stats = out.ssd_stats
    assert stats["eager_call"] and "this call runs eagerly" in stats["controller"]["reason"]
    assert not stats["draft_compiled"]
    memories = _memories()
    assert memories[False].calls == 1 and memories[True].calls == 0  # it learned as an eager call


def test_a_call_whose_compiled_plans_are_built_runs_compiled(monkeypatch):
    monkeypatch.setattr(memory_mod, "_MEMORY", {})
    _compiles_cost(monkeypatch, 0.0)
    from hf_ssd.runtime import static_kv
    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)  # the static path, run eagerly: no compile in a test
    pair = get_pair("llama")
    ids, mask = left_pad([prompt(9, seed=41)[0]])
    out = pair.target.generate(ids, attention_mask=mask, assistant_model=pair.related, **COMPILED)
    assert torch.equal(out.sequences, plain_generate(pair.target, ids, attention_mask=mask, max_new_tokens=16))
    assert not out.ssd_stats["eager_call"]
    assert _memories()[True].calls == 1
