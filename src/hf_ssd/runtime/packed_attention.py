"""Grouped-query attention over a static cache without copying K and V per head.

A static-cache forward passes an explicit mask over all of its slots, and with a mask transformers' SDPA path
expands K and V from the model's KV heads to its query heads (`repeat_kv`) in every layer of every compiled
forward (its copy-free path is for masks of None or eager one-token queries). That copy reads and writes the whole
cache once more per layer: on the project's CPU one layer's attention at batch 16 over 1024 slots took 1.4 ms with
the copy against 0.5 ms without (4 heads on 2 KV heads, head dim 16), and 96 ms against 6 ms at the 1.5B target's
shape (12 heads on 2, head dim 128).

`packed_sdpa` packs each KV head's group of query heads into the query-length dimension instead: queries
[B, H, n, D] become [B, KV, (H / KV) · n, D], the mask's n rows are repeated once per query head of a group, and
SDPA runs on the KV heads as they are. The same dot products, softmaxes and sums (float32 results equal to ~1e-7,
the kernels' own summation order). `slot_view` gives the static caches a twin of the model that uses it: the
same parameters and buffers (shared, not copied), its own module objects and configs, so the caller's model and
its other uses are unchanged.
"""
from __future__ import annotations

import copy
import weakref

import torch

NAME = "hf_ssd_packed_sdpa"
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its slot view (None: none possible)


def packed_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout=0.0,
                scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function interface: (output [B, n, H, Dv], None). Falls back to transformers' SDPA
    where packing does not apply (no grouping, no 4D mask shared by the heads, extra terms SDPA handles itself)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4:
        # a static cache's view (static_kv.StaticCachedModel._slot_view): the slots past the mask are all invalid.
        # Cut always, not only where K is longer: a branch on the view's width (dynamic) would add a guard to it.
        L = attention_mask.shape[-1]
        key, value = key[:, :, :L], value[:, :, :L]
    groups = getattr(module, "num_key_value_groups", 1)
    special = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux"))
    mask_shared = isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4 and attention_mask.shape[1] == 1
    if groups == 1 or special or not mask_shared or query.shape[1] != key.shape[1] * groups:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    B, H, n, D = query.shape
    packed = query.reshape(B, key.shape[1], groups * n, D)  # query head kv * groups + j -> rows j * n .. j * n + n-1
    mask = attention_mask.repeat(1, 1, groups, 1)  # row j * n + t sees what row t does
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(out.shape[0], H, n, value.shape[-1]).transpose(1, 2).contiguous(), None


def _register() -> bool:
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_sdpa)
    return True


def _uses_sdpa(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == "sdpa"


def slot_view(model):
    """The model as the static caches run it: `model` itself where its attention is not transformers' SDPA (eager,
    flash or a custom kernel: left as the caller chose), where accelerate's hooks or `module.compile()` wrap its
    modules (a split or offloaded model, a compiled layer: bound to the original modules), or where this
    transformers has no attention interface; else a twin whose attention is `packed_sdpa` (built once per model,
    kept while the model lives)."""
    if model in _VIEWS:
        return _VIEWS[model] or model
    view = None
    # accelerate's hooks, a forward set on an instance, or `module.compile()`'s call are bound to the original modules
    hooked = any(hasattr(m, "_hf_hook") or "forward" in m.__dict__ or getattr(m, "_compiled_call_impl", None)
                 is not None for m in model.modules())
    if _uses_sdpa(model) and not hooked and _register():
        view = _twin(model, {})
    _VIEWS[model] = view
    return view or model


def _twin(module: torch.nn.Module, configs: dict) -> torch.nn.Module:
    """A copy of the module tree: new module objects over the same parameter and buffer dicts, each config replaced
    by a copy whose attention implementation is NAME (one copy per config object, shared as the originals are)."""
    twin = copy.copy(module)
    twin._modules = {name: None if child is None else _twin(child, configs) for name, child in module._modules.items()}
    config = module.__dict__.get("config")
    if config is not None and hasattr(config, "_attn_implementation_internal"):
        if id(config) not in configs:
            mine = copy.copy(config)
            mine._attn_implementation_internal = NAME
            configs[id(config)] = mine
        twin.config = configs[id(config)]
    return twin
