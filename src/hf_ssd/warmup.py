"""`hf_ssd.warmup(...)`: compile the static draft side's shapes ahead of the first generate(ssd_compile=...), and
(draft_process=True) start the kept draft process that `ssd=True` would otherwise start only once it repays its start.

Compiled graphs and static buffers are kept per process and per (draft model, batch, cache length, dtype, device)
(`runtime.static_kv`), so a generation with the same draft, batch size, K, budget and a max_length in the same
bucket (`static_kv.static_cache_len`: `static_kv.BUCKET` slots times a power of two, at least
`static_kv.MIN_SLOTS`; a cache up to four times larger serves too) finds them ready and reports draft_compile_s == 0.
"""
from __future__ import annotations

import time
import warnings
from typing import Any

from transformers import PreTrainedModel

from hf_ssd.config import SSDConfig
from hf_ssd.runtime import static_kv
from hf_ssd.runtime.static_choice import static_draft_cache
from hf_ssd.workers import pool


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
    draft_process: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Compile the glue (K+1 tokens per row), tree (N = budget branches per row) and backup (1) forwards of
    `draft` for generations of up to `prompt_len + max_new_tokens` tokens in batches of `batch_size`.

    K and budget default to the config's (`config` or SSDConfig()); both must be known, as they fix the shapes.
    Returns {"compile_s", "wall_s", "widths", "max_cache_len", "compiled"}: compiled is False when compiling failed
    (the generation then runs the static cache eagerly) or the draft does not take a static cache.

    draft_process: for a program that will make many `ssd=True` calls (a server). The controller starts a kept draft
    process (its own GIL and core for the tree) only once the seconds it takes to start would be repaid by what the
    calls have generated so far, which a few hundred short calls never reach; this starts it now, waits until it is
    up, and `ssd=True` calls with this draft may choose process-worker plans from their first call. Adds
    {"draft_process": its status ('ready', 'failed: ...', 'not started: ...')}. With no budget (argument or config),
    only that: the controller's plans compile their shapes as they run."""
    if isinstance(config, dict):
        config = SSDConfig.from_dict(config)
    config = (config or SSDConfig()).updated(compile=True)
    K = K if K is not None else config.num_draft_tokens if config.num_draft_tokens is not None else 4
    budget = budget if budget is not None else config.budget
    t0 = time.perf_counter()
    process = {"draft_process": _start_draft_process(draft)} if draft_process else {}
    if budget is None:
        if draft_process:
            return _nothing_compiled(t0, process)
        raise ValueError("warmup needs the tree budget (branches per row): pass budget=..., as ssd_budget to generate() "
                         "(or draft_process=True alone, to start the kept draft process for ssd=True)")
    vocab = target.config.get_text_config().vocab_size
    kv = static_draft_cache(draft, config, batch_size, prompt_len + max_new_tokens, K, budget, vocab, progress=progress)
    if kv is None:
        return _nothing_compiled(t0, process)
    try:  # static_draft_cache compiled every width the generation uses
        compiled = kv.hot_widths <= kv.entry.compiled_widths and static_kv.COMPILE_ENABLED
        return {"compile_s": round(kv.compile_s, 4), "wall_s": round(time.perf_counter() - t0, 4),
                "widths": sorted(kv.hot_widths), "max_cache_len": kv.max_cache_len, "compiled": compiled, **process}
    finally:
        kv.release()


def _nothing_compiled(t0: float, process: dict) -> dict[str, Any]:
    return {"compile_s": 0.0, "wall_s": round(time.perf_counter() - t0, 4), "widths": [], "max_cache_len": None,
            "compiled": False, **process}


def _start_draft_process(draft) -> str:
    """Start `draft`'s kept process (workers.pool) and wait for it; its status. A process that is not up is
    warned about: the caller asked for it, and `ssd=True` then runs no process plan (the reason is in the status:
    a main script that would run again in the spawned child, HF_SSD_AUTO_PROCESS=0, a failed start)."""
    what = pool.start(draft)
    if not what.startswith("not started"):
        what = pool.wait(draft) or what
    if what != "ready":
        warnings.warn(f"hf_ssd.warmup: the kept draft process is not up ({what}); ssd=True calls will run their "
                      "draft in this process", RuntimeWarning, stacklevel=3)
    return what
