"""Turning timed runs into report rows: tokens/s, tokens per round, hit rate, speedups (pure arithmetic, unit-tested)."""
from __future__ import annotations

import math
import statistics
from typing import Any

TPS_METRICS = ("tokens_per_s_decode", "tokens_per_s_e2e")
PLAIN_METHODS = ("plain", "plain:static-compile")  # "best plain" = the faster of these two in a group
SD_METHODS = ("sd", "sd+compile")  # "our SD" = the fastest of these (at any swept K: "sd@K3") in a group

def safe_div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b


def aggregate_runs(runs: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """Totals over the timed runs of one (setting, temperature, batch, method).

    tokens_per_s_e2e    = Σ new tokens / Σ wall
    tokens_per_s_decode = Σ (new tokens − one per row) / Σ (wall − time to first token)
    mean_tokens_per_round = Σ emitted / Σ row-rounds (SD/SSD; from ssd_stats)
    hit_rate            = Σ cache hits / Σ cache lookups
    verify_s etc.       = round-weighted means of ssd_stats.phase_means_s
    round_limit_tps     = batch × mean_tokens_per_round / mean verify time (drafting fully hidden)
    fraction_of_round_limit = tokens_per_s_decode / round_limit_tps
    """
    n_tok = sum(sum(len(t) for t in r["tokens"]) for r in runs)
    rows = sum(len(r["tokens"]) for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    dec_time = sum(r["wall_s"] - r["ttft_s"] for r in runs)
    out: dict[str, Any] = {
        "runs": len(runs), "new_tokens": n_tok, "wall_s": wall,
        "ttft_s": safe_div(sum(r["ttft_s"] for r in runs), len(runs)),
        "tokens_per_s_e2e": safe_div(n_tok, wall),
        "tokens_per_s_decode": safe_div(n_tok - rows, dec_time) if dec_time > 0 else None,
        "peak_rss_mb": max((r["peak_rss_bytes"] for r in runs), default=0) / 2**20,
    }
    stats = [r["ssd_stats"] for r in runs if r.get("ssd_stats")]
    if stats:
        emitted = sum(s["emitted"] for s in stats)
        row_rounds = sum(sum(s["accept_hist"].values()) for s in stats)
        lookups = sum(s["cache_lookups"] for s in stats)
        rounds = sum(s["rounds"] or len(s.get("accept_hist", {})) for s in stats)
        phases: dict[str, float] = {}
        for key in ("verify", "draft", "resolve", "host", "handover", "round"):
            num = den = 0.0
            for s in stats:
                v = (s.get("phase_means_s") or {}).get(key)
                w = s.get("rounds") or 0
                if v is not None and w:
                    num, den = num + v * w, den + w
            phases[key] = num / den if den else None
        ov = [s["overlap_fraction"] for s in stats if s.get("overlap_fraction") is not None]
        accepted_drafts = sum(int(k) * v for s in stats for k, v in s["accept_hist"].items())
        rejections = sum(s.get("rejected", 0) for s in stats)
        out.update({
            "mean_tokens_per_round": safe_div(emitted, row_rounds),
            "mean_accepted_per_round": safe_div(sum(s["accepted"] for s in stats), row_rounds),
            # from the acceptance histogram: a last round cut short by max_new_tokens still counts what was accepted
            "mean_accepted_hist": safe_div(accepted_drafts, row_rounds),
            # a drafted token's acceptance rate: every accepted draft, over those plus each round's first rejection;
            # right whatever K each run used (the controller's plans change K between and within calls)
            "alpha_est": safe_div(accepted_drafts, accepted_drafts + rejections),
            "hit_rate": safe_div(sum(s["cache_hits"] for s in stats), lookups) if lookups else None,
            "rounds": rounds, "phase_means_s": phases,
            "overlap_fraction": sum(ov) / len(ov) if ov else None,
            "budget": stats[-1].get("budget"), "fallback_reason": next(
                (s["fallback_reason"] for s in stats if s.get("fallback_reason")), None),
            "backup_rounds": _sum_counts([s.get("backup_rounds") or {} for s in stats]),
            # rounds whose tree carried the previous round's over (the static SSD drafter; docs/algorithm.md §3)
            "tree_reused": sum(s.get("tree_reused") or 0 for s in stats),
        })
        limit = safe_div(batch * out["mean_tokens_per_round"], phases["verify"]) \
            if out["mean_tokens_per_round"] is not None else None
        out["round_limit_tps"] = limit
        out["fraction_of_round_limit"] = safe_div(out["tokens_per_s_decode"], limit)
    else:
        out.update({"mean_tokens_per_round": None, "mean_accepted_per_round": None, "mean_accepted_hist": None,
                    "alpha_est": None,
                    "hit_rate": None,
                    "round_limit_tps": None, "fraction_of_round_limit": None, "phase_means_s": None,
                    "overlap_fraction": None})
    return out


def _sum_counts(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[str(k)] = total.get(str(k), 0) + int(v)
    return total


def repeat_stats(values: list[float | None]) -> dict[str, Any]:
    """median, min and max of one metric over the repeats (None values left out), and every repeat's value."""
    xs = [v for v in values if v is not None]
    return {"median": statistics.median(xs) if xs else None, "min": min(xs, default=None),
            "max": max(xs, default=None), "runs": list(values)}


def aggregate_repeats(per_repeat: list[list[dict[str, Any]]], batch: int) -> dict[str, Any]:
    """aggregate_runs over every timed run (tokens per round, hit rate, phases, memory), with the tokens/s figures
    replaced by their median over the repeats (one repeat = every prompt batch once) and the spread kept in
    `<metric>_stats` = {median, min, max, runs}. fraction_of_round_limit is recomputed from the median."""
    out = aggregate_runs([r for rep in per_repeat for r in rep], batch)
    for metric in TPS_METRICS:
        st = repeat_stats([aggregate_runs(rep, batch)[metric] for rep in per_repeat])
        out[metric], out[f"{metric}_stats"] = st["median"], st
    out["repeats"] = len(per_repeat)
    out["fraction_of_round_limit"] = safe_div(out["tokens_per_s_decode"], out.get("round_limit_tps"))
    return out


def add_speedups(results: list[dict[str, Any]]) -> None:
    """speedup_vs_plain / _vs_best_plain / _vs_hf_best / _vs_sd within each (setting, temperature, batch, prompt set)
    group, on decode tok/s and on end-to-end tok/s (suffix _e2e); the tok/s are medians over repeats.
    plain = eager plain generate(); best_plain = the faster of plain and plain:static-compile; hf_best = the fastest
    transformers speculative method of the group (assisted-generation schedules and prompt lookup); sd = our
    synchronous SD at its best compile setting and K (the fastest of sd and sd+compile, at every K the run swept)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["temperature"], r["batch_size"], r.get("prompt_set")), []).append(r)
    for rs in groups.values():
        for metric, suffix in (("tokens_per_s_decode", ""), ("tokens_per_s_e2e", "_e2e")):
            by = {r["method"]: r[metric] for r in rs}
            hf = [v for m, v in by.items() if m.startswith("hf:") and v]
            plains = [by[m] for m in PLAIN_METHODS if by.get(m)]
            sds = [v for m, v in by.items() if m.split("@")[0] in SD_METHODS and v]
            refs = {"plain": by.get("plain"), "best_plain": max(plains) if plains else None,
                    "hf_best": max(hf) if hf else None, "sd": max(sds) if sds else None}
            for r in rs:
                for ref, v in refs.items():
                    r[f"speedup_vs_{ref}{suffix}"] = safe_div(r[metric], v)


def greedy_equal(outputs: list[list[int]], reference: list[list[int]]) -> tuple[bool, int]:
    """(all equal, number of rows that differ) between a method's per-row tokens and plain's."""
    diff = sum(1 for a, b in zip(outputs, reference) if a != b) + abs(len(outputs) - len(reference))
    return diff == 0, diff
