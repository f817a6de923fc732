"""A setting's first calls compile whatever plan they choose (control.compiled, the warm-up a user opts into with
ssd_compile): COMPILE_FREE_CALLS calls of the controller's own choice. Calls that start on a plan run to measure it
(an exploration, a second look) do not count: at α = 1 four of the first six calls explored or looked again, and the
plan the controller would have chosen once α was measured (K = 8) was priced with its compile from then on."""
from __future__ import annotations

import torch

from hf_ssd.control import memory as memory_mod
from hf_ssd.control.compiled import COMPILE_FREE_CALLS, COMPILE_FREE_MAX_CALLS, compiling_free
from hf_ssd.control.memory import Memory
from hf_ssd.testing import PAD, get_pair, prompt


def test_exploring_calls_do_not_use_up_the_free_ones():
    assert compiling_free(Memory())
    assert not compiling_free(Memory(calls=COMPILE_FREE_CALLS))
    assert compiling_free(Memory(calls=COMPILE_FREE_CALLS + 2, exploring_calls=3))
    assert not compiling_free(Memory(calls=COMPILE_FREE_CALLS + 3, exploring_calls=3))
    assert not compiling_free(Memory(calls=COMPILE_FREE_MAX_CALLS, exploring_calls=COMPILE_FREE_MAX_CALLS))  # bounded
    memory = Memory()
    memory.call_explores = True
    memory.end_call()
    memory.end_call()
    assert (memory.calls, memory.exploring_calls, memory.call_explores) == (2, 1, False)


def test_each_call_says_whether_it_explored_and_compiled_for_free(monkeypatch):
    """`ssd=True` call by call: the calls whose record says they explored are those the setting counts, and a call
    is free while fewer than COMPILE_FREE_CALLS calls before it ran the controller's own choice."""
    monkeypatch.setattr(memory_mod, "_MEMORY", {})  # a fresh setting
    p = get_pair("llama")
    records = []
    for call in range(COMPILE_FREE_CALLS + 4):
        with torch.no_grad():  # no options: the controller chooses
            out = p.target.generate(prompt(12, seed=60 + call), assistant_model=p.related, ssd=True, do_sample=False,
                                    pad_token_id=PAD, max_new_tokens=12, return_dict_in_generate=True)
        records.append(out.ssd_stats["controller"])
    (memory,) = memory_mod._MEMORY.values()
    explored = [r["exploring"] for r in records]
    assert memory.calls == len(records) and memory.exploring_calls == sum(explored)
    chosen_before = [sum(not e for e in explored[:i]) for i in range(len(records))]
    assert [r["compiling_free"] for r in records] == [n < COMPILE_FREE_CALLS for n in chosen_before]
    assert not records[-1]["compiling_free"]
