"""The default cache budget: as many branches per row as keep the tree build within one target verify.

Measured once per (target, draft, K, batch) in this process on the real models, since the answer depends on the
hardware: the glue forward plus K tree steps of B*N tokens must fit in the time of one verify of B*(K+1) tokens.
"""
from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from hf_ssd.runtime.kv import cache_argument, input_device

_MEASURED: dict[tuple, int] = {}
CANDIDATES = (1, 2, 4, 8, 16, 32)


def _time_forward(model, batch: int, n: int, prefix: int = 32, repeats: int = 2) -> float:
    device = input_device(model)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, prefix + n), device=device)
    best = float("inf")
    cache = DynamicCache()
    cache_kw = cache_argument(model)
    with torch.no_grad():
        model(input_ids=ids[:, :prefix], use_cache=True, **{cache_kw: cache})
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids[:, prefix:], use_cache=True, **{cache_kw: cache})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
            cache.crop(-n)
    return best


def measure_budget(target, draft, K: int, batch: int) -> int:
    """Largest N (branches per row) with t_glue + K * t_step(N) <= t_verify; at least K+1 (one guess per k)."""
    key = (id(target), id(draft), K, batch)
    if key not in _MEASURED:
        t_verify = _time_forward(target, batch, K + 1)
        t_glue = _time_forward(draft, batch, K + 1)
        best = K + 1
        for n in CANDIDATES:
            if n <= K + 1:
                continue
            if t_glue + K * _time_forward(draft, batch, n) > t_verify:
                break
            best = n
        _MEASURED[key] = best
    return _MEASURED[key]
