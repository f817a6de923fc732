"""The static caches' attention without a K/V copy per query head (runtime/packed_attention.py): the same logits as
transformers' SDPA, on the same weights, with the caller's model untouched."""
from __future__ import annotations

import pytest
import torch

from hf_ssd.runtime.packed_attention import NAME, packed_sdpa, slot_view
from hf_ssd.runtime.static_kv import StaticCachedModel
from hf_ssd.testing import build_target, prompt


def _slot_mask(batch: int, n: int, slots: int, seed: int) -> torch.Tensor:
    """A float mask like a static cache's: each query sees a random subset of the slots, and always its own."""
    g = torch.Generator().manual_seed(seed)
    seen = torch.rand(batch, 1, n, slots, generator=g) < 0.6
    seen[..., torch.arange(n), slots - n + torch.arange(n)] = True
    return torch.zeros(seen.shape).masked_fill_(~seen, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_the_view_computes_what_the_model_does_with_packed_queries(arch, monkeypatch):
    model = build_target(arch)
    view = slot_view(model)
    assert view is not model and slot_view(model) is view  # one view per model
    assert view.config._attn_implementation == NAME and model.config._attn_implementation == "sdpa"
    assert all(a is b for a, b in zip(view.parameters(), model.parameters()))  # the same weights, not copies
    ids = prompt(12).repeat(3, 1)
    mask = _slot_mask(3, 12, 12, seed=0)
    queries = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: (queries.append(tuple(q.shape)), sdpa(q, *a, **kw))[1])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        queries.clear()
        got = view(input_ids=ids, attention_mask=mask).logits
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert queries and all(q[1] == kv_heads and q[2] == 12 * heads // kv_heads for q in queries)  # packed, no copy
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_where_packing_does_not_apply_it_is_transformers_sdpa():
    """No 4D mask shared by the heads (a causal prefill passes none): transformers' own SDPA, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = build_target("llama")
    attn = model.model.layers[0].self_attn
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    for mask in (None, torch.zeros(2, 4, 5, 5)):
        got, _ = packed_sdpa(attn, q, k, v, mask, scaling=0.3)
        expected, _ = sdpa_attention_forward(attn, q, k, v, mask, scaling=0.3)
        assert torch.equal(got, expected)


def test_models_it_leaves_alone():
    """Eager attention (the caller's choice), and modules whose forward is set on the instance (accelerate's
    hooks, a compiled call) bound to the original modules: the static caches run the model itself."""
    eager = build_target("qwen2")
    eager.set_attn_implementation("eager")
    assert slot_view(eager) is eager
    hooked = build_target("qwen2")
    hooked.model.layers[0].forward = hooked.model.layers[0].forward
    assert slot_view(hooked) is hooked
    compiled = build_target("qwen2")
    compiled.model.layers[1].compile()  # torch.compile in place: its compiled call is bound to the original layer
    assert slot_view(compiled) is compiled
    gpt2 = build_target("gpt2")  # no grouped heads: the view falls back to SDPA inside, and still matches
    ids = prompt(6)
    with torch.no_grad():
        torch.testing.assert_close(slot_view(gpt2)(input_ids=ids).logits, gpt2(input_ids=ids).logits)


def test_static_caches_run_the_view_except_for_the_prefill(monkeypatch):
    model = build_target("qwen2")
    kv = StaticCachedModel(model, 1, 256)
    assert kv.slot_model is slot_view(model) and kv.slot_model is not model
    from transformers import AttentionInterface

    ran = []
    monkeypatch.setitem(AttentionInterface._global_mapping, NAME,
                        lambda *a, **kw: (ran.append(1), packed_sdpa(*a, **kw))[1])
    ids = prompt(8)
    kv.forward(ids, torch.arange(8)[None], prefill=True)
    assert not ran  # the prefill: transformers' SDPA on the model itself
    kv.forward(ids[:, :2], torch.arange(8, 10)[None])
    assert ran
