"""`hf_ssd.warmup(...)`: compile the static draft side's shapes ahead of the first generate(ssd_compile=...).

Compiled graphs and static buffers are kept per process and per (draft model, batch, cache length, dtype, device)
(`runtime.static_kv`), so a generation with the same draft, batch size, K, budget and a max_length in the same
bucket (`static_kv.static_cache_len`: `static_kv.BUCKET` slots times a power of two; a cache up to four times
larger serves too) finds them ready and reports draft_compile_s == 0.
"""
from __future__ import annotations

import time
from typing import Any

from transformers import PreTrainedModel

from hf_ssd.config import SSDConfig
from hf_ssd.runtime import static_kv
from hf_ssd.runtime.static_choice import static_draft_cache


def warmup(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    *,
    batch_size: int = 1,
    max_new_tokens: int = 256,
    prompt_len: int = 256,
    K: int | None = None,
    budget: int | None = None,
    config: SSDConfig | dict | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Compile the glue (K+1 tokens per row), tree (N = budget branches per row) and backup (1) forwards of
    `draft` for generations of up to `prompt_len + max_new_tokens` tokens in batches of `batch_size`.

    K and budget default to the config's (`config` or SSDConfig()); both must be known, as they fix the shapes.
    Returns {"compile_s", "wall_s", "widths", "max_cache_len", "compiled"}: compiled is False when compiling failed
    (the generation then runs the static cache eagerly) or the draft does not take a static cache."""
    if isinstance(config, dict):
        config = SSDConfig.from_dict(config)
    config = (config or SSDConfig()).updated(compile=True)
    K = K if K is not None else config.num_draft_tokens if config.num_draft_tokens is not None else 4
    budget = budget if budget is not None else config.budget
    if budget is None:
        raise ValueError("warmup needs the tree budget (branches per row): pass budget=..., as ssd_budget to generate()")
    vocab = target.config.get_text_config().vocab_size
    t0 = time.perf_counter()
    kv = static_draft_cache(draft, config, batch_size, prompt_len + max_new_tokens, K, budget, vocab, progress=progress)
    if kv is None:
        return {"compile_s": 0.0, "wall_s": time.perf_counter() - t0, "widths": [], "max_cache_len": None,
                "compiled": False}
    try:  # static_draft_cache compiled every width the generation uses
        compiled = kv.hot_widths <= kv.entry.compiled_widths and static_kv.COMPILE_ENABLED
        return {"compile_s": round(kv.compile_s, 4), "wall_s": round(time.perf_counter() - t0, 4),
                "widths": sorted(kv.hot_widths), "max_cache_len": kv.max_cache_len, "compiled": compiled}
    finally:
        kv.release()
