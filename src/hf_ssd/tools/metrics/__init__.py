"""evaluate metric modules shipped with hf_ssd, loaded from local paths (no Hub):

    evaluate.load(hf_ssd.tools.metrics.path("ssd_fidelity"))                   # greedy identity rate
    evaluate.load(hf_ssd.tools.metrics.path("ssd_fidelity"), "distribution")   # chi-square test at T > 0
    evaluate.load(hf_ssd.tools.metrics.path("ssd_acceptance"))                 # mean accepted length, hit rate
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

METRICS = ("ssd_fidelity", "ssd_acceptance")


def path(name: str) -> str:
    """Local directory of metric `name`, for evaluate.load()."""
    if name not in METRICS:
        raise KeyError(f"unknown metric {name!r}; choose one of {METRICS}")
    return str(Path(__file__).parent / name)


def load(name: str, config_name: str | None = None, **kwargs: Any):
    import evaluate

    return evaluate.load(path(name), config_name, **kwargs)


def acceptance_inputs(stats: Iterable[dict[str, Any]]) -> dict[str, list[int]]:
    """Columns for ssd_acceptance from generate()'s `ssd_stats` dicts (one entry per batch row)."""
    cols: dict[str, list[int]] = {"accepted": [], "rounds": [], "cache_hits": [], "cache_lookups": []}
    for s in stats:
        rows = s.get("per_row") or {}
        if rows.get("rounds"):
            cols["accepted"] += list(rows["accepted"])
            cols["rounds"] += list(rows["rounds"])
            cols["cache_hits"] += list(rows.get("hits") or [0] * len(rows["rounds"]))
            cols["cache_lookups"] += list(rows.get("lookups") or [0] * len(rows["rounds"]))
        else:
            cols["accepted"].append(int(s.get("accepted", 0)))
            cols["rounds"].append(int(s.get("rounds", 0)))
            cols["cache_hits"].append(int(s.get("cache_hits", 0)))
            cols["cache_lookups"].append(int(s.get("cache_lookups", 0)))
    return cols
