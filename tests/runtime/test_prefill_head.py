"""A prompt's prefill computes the LM head for its last position only (its logits are never read): the KV it leaves
is the full forward's, so the next forward's logits are the same; models without `logits_to_keep` get every
position, as before."""
from __future__ import annotations

import pytest
import torch

from hf_ssd.runtime.kv import CachedModel, prefill_logits_argument
from hf_ssd.runtime.static_kv import StaticCachedModel
from hf_ssd.testing import get_pair, left_pad, prompt


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("static", [False, True])
def test_prefill_skips_the_head_and_changes_nothing_after_it(arch, static):
    model = get_pair(arch).target
    ids, mask = left_pad([prompt(9, seed=31)[0], prompt(5, seed=32)[0]])
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)

    def run(prefill: bool):
        kv = StaticCachedModel(model, 2, 32) if static else CachedModel(model, 2)
        first = kv.forward(ids[:, :-1], positions[:, :-1], mask[:, :-1].bool(), prefill=prefill)
        nxt = kv.forward(ids[:, -1:], positions[:, -1:])
        if static:
            kv.release()
        return first, nxt

    head, after = run(prefill=True)
    full, reference = run(prefill=False)
    keeps = bool(prefill_logits_argument(model))
    assert head.shape[1] == (1 if keeps else ids.shape[1] - 1)
    assert full.shape[1] == ids.shape[1] - 1
    torch.testing.assert_close(head[:, -1], full[:, -1])
    torch.testing.assert_close(after, reference)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_static_prefill_attends_over_the_slots_in_use_only(arch, monkeypatch):
    """A static cache of 256 slots: the prompt's prefill reads the slots it writes (its keys are that long), the
    next forward reads all of them, and the next logits equal a dynamic cache's."""
    from hf_ssd.runtime import slot_step as slot_mod
    from hf_ssd.runtime import static_registry

    model = get_pair(arch).target
    ids, mask = left_pad([prompt(9, seed=33)[0], prompt(5, seed=34)[0]])
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    read: list[int] = []
    update = slot_mod.SlotLayer.update

    def recording(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        read.append(keys.shape[2])
        return keys, values

    monkeypatch.setattr(slot_mod.SlotLayer, "update", recording)
    static_registry.clear(model)  # else a free larger cache of an earlier test may be lent (static_registry.acquire)
    kv = StaticCachedModel(model, 2, 256)
    try:
        kv.forward(ids[:, :-1], positions[:, :-1], mask[:, :-1].bool(), prefill=True)
        prefill_reads, read[:] = list(read), []
        static_next = kv.forward(ids[:, -1:], positions[:, -1:])
    finally:
        kv.release()
    assert set(prefill_reads) == {ids.shape[1] - 1}
    assert set(read) == {256}
    dynamic = CachedModel(model, 2)
    dynamic.forward(ids[:, :-1], positions[:, :-1], mask[:, :-1].bool(), prefill=True)
    torch.testing.assert_close(static_next, dynamic.forward(ids[:, -1:], positions[:, -1:]))
