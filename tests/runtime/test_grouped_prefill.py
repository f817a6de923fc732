"""A left-padded batch's prompt is prefilled in groups of rows of similar length (runtime.prefill), without the
padding's compute:

- the grouping is the cheapest split of the length-sorted rows (checked against every split by brute force), and
  none where one padded forward costs as little;
- the cache it leaves holds what the padded prefill leaves, on every tiny architecture, dynamic and static: the
  same validity, positions and pointers, and the same logits after it (to float rounding);
- an unpadded prefill of an empty dynamic cache passes no mask (SDPA's causal kernel) for the listed families;
- greedy output with grouping forced equals plain generate() (sync and SSD, dynamic and static caches); the T > 0
  law with grouping forced is checked in tests/exactness/test_sampling_exact.py.
"""
from __future__ import annotations

import functools
import itertools

import pytest
import torch

from hf_ssd.runtime import prefill as prefill_mod
from hf_ssd.runtime import static_kv
from hf_ssd.runtime.kv import CAUSAL_PREFILL_MODELS, CachedModel, attention_layout
from hf_ssd.runtime.prefill import padding_groups, prefill_prompt
from hf_ssd.runtime.static_kv import StaticCachedModel
from hf_ssd.testing import ARCHS, get_pair, left_pad, plain_generate, prompt, ssd_generate


@pytest.fixture
def always_grouped(monkeypatch):
    """Group wherever any padding is saved (the tiny prompts here are far below the real per-forward cost)."""
    monkeypatch.setitem(prefill_mod.FORWARD_TOKENS, "cpu", 0)
    monkeypatch.setattr(prefill_mod, "GROUPED_AT_MOST", 0.999)


def _valid(widths: list[int], n: int) -> torch.Tensor:
    return torch.stack([torch.arange(n) >= n - w for w in widths])


def _cost(groups, widths, forward_tokens):
    return sum(len(g.rows) * widths[g.rows[0]] + forward_tokens for g in groups)


# ---- the grouping -----------------------------------------------------------------------------------------------
def test_no_padding_and_single_rows_are_not_grouped():
    assert padding_groups(_valid([9, 9, 9], 9), 0) is None
    assert padding_groups(_valid([3], 9), 0) is None
    assert padding_groups(_valid([0, 0], 9), 0) is None


def test_rows_of_similar_length_share_a_forward():
    widths = [500, 40, 480, 30, 0, 510]
    groups = padding_groups(_valid(widths, 510), 64)
    assert [g.rows for g in groups] == [[5, 0, 2], [1, 3]]  # the empty row needs no forward
    assert [g.start for g in groups] == [0, 470]
    # a forward worth more than the padding it saves: one padded forward
    assert padding_groups(_valid([500, 450], 500), 64) is None


@pytest.mark.parametrize("seed", range(20))
def test_the_grouping_is_the_cheapest_split(seed):
    g = torch.Generator().manual_seed(seed)
    B, n = int(torch.randint(2, 7, (1,), generator=g)), 40
    widths = torch.randint(0, n + 1, (B,), generator=g).tolist()
    widths[0] = n
    overhead = int(torch.randint(0, 30, (1,), generator=g))
    groups = padding_groups(_valid(widths, n), overhead)
    order = sorted((r for r in range(B) if widths[r] > 0), key=lambda r: -widths[r])
    best = min(
        sum(len(run) * widths[run[0]] + overhead for run in _runs(order, cuts))
        for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k)
    )
    if groups is None:
        assert best > prefill_mod.GROUPED_AT_MOST * (B * n + overhead)
    else:
        assert _cost(groups, widths, overhead) == best
        assert sorted(r for grp in groups for r in grp.rows) == sorted(order)
        for grp in groups:
            assert all(n - widths[r] >= grp.start for r in grp.rows)


def _runs(order, cuts):
    bounds = [0, *cuts, len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


# ---- the cache it leaves ----------------------------------------------------------------------------------------
def _rows():
    """Left-padded rows of lengths 5, 17, 1 (nothing to prefill) and 16."""
    return left_pad([prompt(5, seed=1)[0], prompt(17, seed=2)[0], prompt(1, seed=3)[0], prompt(16, seed=4)[0]])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_grouped_prefill_leaves_the_padded_prefill_s_cache(arch, static, always_grouped):
    model = get_pair(arch).target
    ids, mask = _rows()
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    assert len(padding_groups(mask[:, :-1].bool(), 0)) == 3
    step = torch.randint(2, 90, (4, 3), generator=torch.Generator().manual_seed(0))
    out = []
    for grouped in (False, True):
        kv = StaticCachedModel(model, 4, 64) if static else CachedModel(model, 4)
        with torch.inference_mode():
            if grouped:
                prefill_prompt(kv, ids, mask)
            else:
                kv.forward(ids[:, :-1], positions[:, :-1], mask[:, :-1].bool(), prefill=True)
            state = (kv.valid.clone(), kv.pos.clone(), kv.write_pointer(), kv.next_position())
            last = kv.forward(ids[:, -1:], positions[:, -1:])
            after = kv.forward(step, positions[:, -1:] + 1 + torch.arange(3))
        out.append((state, last, after))
        if static:
            kv.release()
    (state0, last0, after0), (state1, last1, after1) = out
    n = ids.shape[1] - 1
    for a, b in zip(state0, state1):
        assert torch.equal(a[..., :n] if a.dim() == 2 else a, b[..., :n] if b.dim() == 2 else b)
    torch.testing.assert_close(last1, last0, atol=2e-5, rtol=0)
    torch.testing.assert_close(after1, after0, atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_unpadded_dynamic_prefill_runs_causal_and_matches_the_masked_one(arch, monkeypatch):
    model = get_pair(arch).target
    expected = model.config.model_type in CAUSAL_PREFILL_MODELS and attention_layout(model) == (None, None)
    masks = []
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature: the cache keyword is read off it
    def spy(*args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    ids = prompt(12, seed=21)
    step = torch.randint(2, 90, (1, 2), generator=torch.Generator().manual_seed(4))
    out = {}
    for listed in (True, False):
        monkeypatch.setattr("hf_ssd.runtime.kv.CAUSAL_PREFILL_MODELS", CAUSAL_PREFILL_MODELS if listed else ())
        kv = CachedModel(model, 1)
        first = kv.forward(ids, torch.arange(12)[None], prefill=True)
        out[listed] = (first, kv.forward(step, torch.arange(12, 14)[None]))
    assert [m is None for m in masks] == [expected, False, False, False]
    torch.testing.assert_close(out[True], out[False], atol=2e-5, rtol=0)


# ---- generate() with grouping forced -----------------------------------------------------------------------------
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("mode", ["sync", "ssd"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_greedy_output_with_grouped_prefills_is_plain_generate_s(arch, mode, static, always_grouped, monkeypatch):
    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)
    calls = []
    real = prefill_mod.padding_groups
    monkeypatch.setattr(prefill_mod, "padding_groups", lambda *a: calls.append(real(*a)) or calls[-1])
    p = get_pair(arch)
    rows = [prompt(L, seed=60 + i)[0] for i, L in enumerate([3, 14, 13, 6, 1])]
    ids, mask = left_pad(rows)
    extra = dict(ssd_compile=True, ssd_compile_target=True) if static else {}
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=12, ssd_mode=mode,
                       ssd_num_draft_tokens=3, ssd_worker="inline", **extra)
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=12)
    seqs = out.sequences if hasattr(out, "sequences") else out
    assert torch.equal(seqs, ref), f"\nssd:   {seqs.tolist()}\nplain: {ref.tolist()}"
    assert len(calls) >= 2 and all(c is not None and len(c) >= 2 for c in calls)  # target and draft grouped
