"""A synchronous draft's static cache has room for the call plus one hole per new token, not for the call twice:
every draft step attends over all its slots, and counting the prompt twice doubled them for long prompts."""
from __future__ import annotations

import copy

import torch

from hf_ssd import session
from hf_ssd.runtime import static_kv
from hf_ssd.runtime.static_choice import sync_sequence_len
from hf_ssd.runtime.static_kv import static_cache_len
from hf_ssd.testing import get_pair, plain_generate, prompt, ssd_generate


def test_the_room_counts_the_new_tokens_twice_and_the_prompt_once():
    assert sync_sequence_len(160, 100) == 220
    assert sync_sequence_len(160) == 320  # prompt unknown: the old, safe bound
    assert sync_sequence_len(160, 500) == 160  # a prompt can not be longer than the call


def test_a_draft_rejected_every_round_still_fits(monkeypatch):
    """The worst case for holes: a draft that never agrees leaves one per new token. With a 100-token prompt and 60
    new tokens the cache is 256 slots (it was 512), and the output is plain generate()'s."""
    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)  # the static cache, run eagerly (fast)
    monkeypatch.setattr(static_kv, "MIN_SLOTS", static_kv.BUCKET)  # sizes from the smallest bucket, not the floor
    p = get_pair("llama")
    target, draft = copy.deepcopy(p.target), copy.deepcopy(p.target)  # fresh models: fresh static caches
    with torch.no_grad():
        draft.lm_head.weight.neg_()  # its first choice is the target's last
    built = []

    def capture(*args, **kw):
        kv = real(*args, **kw)
        built.append(kv)
        return kv

    real = session.static_draft_cache
    monkeypatch.setattr(session, "static_draft_cache", capture)
    ids = prompt(100, seed=5)
    new = 60
    ref = plain_generate(target, ids, max_new_tokens=new)
    out = ssd_generate(target, draft, ids, max_new_tokens=new, return_dict_in_generate=True, ssd_mode="sync",
                       ssd_num_draft_tokens=3, ssd_compile=True)
    st = out.ssd_stats
    assert torch.equal(out.sequences, ref)
    assert st["fallback_reason"] is None and st["draft_static"]
    assert st["accepted"] <= 2 and st["rounds"] >= new - 2  # (almost) every round rejected its drafts
    (kv,) = [k for k in built if k is not None]
    assert kv.max_cache_len == static_cache_len(sync_sequence_len(100 + new, 100), 8, 0) == 256
