"""Bench report: JSON schema check, Markdown table, PNG plots (matplotlib, Agg backend)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2  # 2: repeats (tok/s = median, *_stats spread), prompt_set per row, workload, method_errors

TOP_KEYS = {
    "schema_version": int, "command": str, "created": str, "duration_s": (int, float), "config": dict,
    "workload": str, "models": dict, "versions": dict, "machine": dict, "workers": dict, "methods": list,
    "method_errors": dict, "prompt_sets": list, "prompts": list, "results": list, "samples": list, "notes": list,
}
NUM = (int, float, type(None))
RESULT_KEYS = {
    "setting": str, "temperature": (int, float), "batch_size": int, "prompt_set": str, "method": str, "kind": str,
    "runs": int, "repeats": int, "new_tokens": int, "wall_s": (int, float), "ttft_s": NUM,
    "tokens_per_s_e2e": NUM, "tokens_per_s_decode": NUM, "tokens_per_s_e2e_stats": dict,
    "tokens_per_s_decode_stats": dict,
    "speedup_vs_plain": NUM, "speedup_vs_best_plain": NUM, "speedup_vs_hf_best": NUM, "speedup_vs_sd": NUM,
    "speedup_vs_plain_e2e": NUM, "speedup_vs_best_plain_e2e": NUM, "speedup_vs_hf_best_e2e": NUM,
    "speedup_vs_sd_e2e": NUM,
    "mean_tokens_per_round": NUM, "hit_rate": NUM, "round_limit_tps": NUM, "fraction_of_round_limit": NUM,
    "peak_rss_mb": (int, float), "greedy_equal": (bool, type(None)),
}
PLOTS = ("speedup_by_category.png", "tps_vs_batch.png", "hit_rate_vs_temperature.png")


def finalize(report: dict[str, Any]) -> dict[str, Any]:
    report["schema_version"] = SCHEMA_VERSION
    return report


def validate_report(report: dict[str, Any]) -> list[str]:
    """Problems with the report (empty list = valid): missing keys, wrong types, inconsistent values."""
    errs = []
    for k, t in TOP_KEYS.items():
        if k not in report:
            errs.append(f"missing top-level key {k!r}")
        elif not isinstance(report[k], t):
            errs.append(f"{k!r} has type {type(report[k]).__name__}")
    for i, r in enumerate(report.get("results") or []):
        for k, t in RESULT_KEYS.items():
            if k not in r:
                errs.append(f"results[{i}] ({r.get('method')}) missing {k!r}")
            elif not isinstance(r[k], t) or (isinstance(r[k], float) and math.isnan(r[k])):
                errs.append(f"results[{i}].{k} = {r[k]!r} has a bad type/value")
        if r.get("kind") in ("sd", "ssd") and r.get("mean_tokens_per_round") is None:
            errs.append(f"results[{i}] ({r.get('method')}) has no mean_tokens_per_round")
        if r.get("kind") == "ssd" and r.get("hit_rate") is None and not r.get("fallback_reason"):
            errs.append(f"results[{i}] ({r.get('method')}) has no hit_rate")
        if r.get("temperature") == 0 and r.get("greedy_equal") is None:
            errs.append(f"results[{i}] ({r.get('method')}) greedy run without an equality check")
        for k in ("tokens_per_s_decode_stats", "tokens_per_s_e2e_stats"):
            st = r.get(k)
            if isinstance(st, dict) and (not {"median", "min", "max", "runs"} <= set(st)
                                         or len(st.get("runs") or []) != r.get("repeats")):
                errs.append(f"results[{i}].{k} needs median, min, max and one value per repeat")
    if not report.get("results"):
        errs.append("no results")
    return errs


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _spread(r: dict[str, Any], metric: str) -> str:
    """"median (min–max)" over the repeats; the bare value for a row without repeat statistics."""
    st = r.get(f"{metric}_stats")
    if not st or st.get("median") is None:
        return _fmt(r.get(metric))
    return f"{st['median']:.2f} ({st['min']:.2f}–{st['max']:.2f})"


def markdown_table(report: dict[str, Any]) -> str:
    """One row per result; tok/s as "median (min–max)" over the repeats, ratios from the medians (of decode tok/s,
    and of end-to-end tok/s where the column says e2e)."""
    cols = [("setting", "setting", None), ("T", "temperature", "g"), ("batch", "batch_size", None),
            ("prompts", "prompt_set", None), ("method", "method", None),
            ("tok/s decode", "tokens_per_s_decode", "spread"), ("tok/s e2e", "tokens_per_s_e2e", "spread"),
            ("× plain", "speedup_vs_plain", ".2f"), ("× best plain", "speedup_vs_best_plain", ".2f"),
            ("× HF best", "speedup_vs_hf_best", ".2f"), ("× our SD", "speedup_vs_sd", ".2f"),
            # end to end (prefills included): what a caller waits for, and what ssd:auto's controller ranks by
            ("× best plain e2e", "speedup_vs_best_plain_e2e", ".2f"), ("× our SD e2e", "speedup_vs_sd_e2e", ".2f"),
            ("tok/round", "mean_tokens_per_round", ".2f"), ("α est", "alpha_est", ".2f"),
            ("hit rate", "hit_rate", ".0%"), ("of round limit", "fraction_of_round_limit", ".0%"),
            ("peak RSS MB", "peak_rss_mb", ".0f"), ("= plain (greedy)", "greedy_equal", None)]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    mcol = [c[1] for c in cols].index("method")
    for r in report["results"]:
        cells = [_spread(r, k) if f == "spread" else _fmt(r.get(k), f) if f else _fmt(r.get(k)) for _, k, f in cols]
        if r.get("fallback_reason"):  # the engine gave up on SSD and ran sync SD: say so next to the numbers
            cells[mcol] += f" (FELL BACK to sync SD: {r['fallback_reason']})"
        if r.get("controller_choice"):  # ssd:auto: the plan the controller ran
            cells[mcol] += f" (ran {r['controller_choice']}" + (
                f", {r['controller_switches']} switch(es))" if r.get("controller_switches") else ")")
        if r.get("graphs_compiled_in_timed_runs"):  # compilation leaked into the timing: flag it
            cells[mcol] += f" (COMPILED {r['graphs_compiled_in_timed_runs']} graph(s) while timed)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phase_table(report: dict[str, Any]) -> str:
    """Where a round's time goes (SD/SSD): mean seconds of verify, draft, resolve, round; overlap."""
    lines = ["| setting | T | batch | prompts | method | verify ms | draft ms | resolve ms | host ms | hand-over ms | "
             "round ms | overlap | budget |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        ph = r.get("phase_means_s")
        if not ph:
            continue
        ms = [_fmt(None if ph.get(k) is None else 1000 * ph[k], ".1f" if k in ("host", "handover") else ".0f")
              for k in ("verify", "draft", "resolve", "host", "handover", "round")]
        lines.append(f"| {r['setting']} | {r['temperature']:g} | {r['batch_size']} | {r.get('prompt_set', '–')} | "
                     f"{r['method']} | "
                     + " | ".join(ms) + f" | {_fmt(r.get('overlap_fraction'), '.0%')} | {_fmt(r.get('budget'))} |")
    return "\n".join(lines)


# What each prompt set is, for the report: HumanEval is the set tuning (e.g. an automatic controller) may have used;
# MT-Bench and ShareGPT are the held-out sets to quote.
PROMPT_SET_ROLES = {
    "humaneval": "HumanEval code prompts (may have been used for tuning)",
    "mtbench": "MT-Bench first turns (held out: not HumanEval)",
    "sharegpt": "ShareGPT first turns (held out: not HumanEval)",
}
WORKLOAD_ROLES = {
    "default": "the model pair as given (real models, or --tiny random ones)",
    "overhead": "overhead-bound CPU stand-in for the GPU regime (real layer counts, tiny widths; see "
                "hf_ssd/tools/bench/overhead.py)",
}


def markdown(report: dict[str, Any]) -> str:
    m, cfg = report["machine"], report["config"]
    sets = report.get("prompt_sets") or cfg["prompts"]
    workload = report.get("workload", cfg.get("workload", "default"))
    errors = report.get("method_errors") or {}
    compiled = [r for r in report["results"] if r.get("option") == "static-compile" or r.get("engine_compiled")]
    parts = [
        "# hf-ssd bench", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m.get('cpu_model', m.get('processor'))}, {m.get('cpu_count')} cores, "
        f"{m.get('mem_total_gb', '?')} GB; {m.get('platform')}", "",
        f"Workload: **{workload}**: {WORKLOAD_ROLES.get(workload, '?')}.", "",
        f"Models: {report['models'].get('pair')} ({report['models'].get('dtype')}); versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
        "Prompt set(s): " + "; ".join(f"**{s}** = {PROMPT_SET_ROLES.get(s, s)}" for s in sets)
        + f" — {cfg['num_prompts']} per set ({len(report['prompts'])} total), each set on its own rows.", "",
        f"max_new_tokens={cfg['max_new_tokens']}, K={cfg['K']}, budget={cfg['budget'] or 'auto'}, "
        f"C={cfg['downweight']}, warmup={cfg['warmup']} (plain:static-compile: at least 1, until compiled), "
        f"repeats={cfg['repeats']} (tok/s: median (min–max) over "
        f"the repeats; ratios from the medians); run took {report['duration_s']:.0f} s.", "",
        f"SSD workers benchmarked: {', '.join(report['workers']['available']) or 'none'}"
        + ("; skipped: " + "; ".join(f"{k} ({v})" for k, v in report["workers"]["skipped"].items())
           if report["workers"]["skipped"] else ""), "",
        *([f"Compiled rows (plain:static-compile, +compile): warm-up incl. torch.compile up to "
           f"{max(r.get('warmup_s') or 0.0 for r in compiled):.0f} s per row (untimed); graphs compiled while timed: "
           f"{sum(r.get('graphs_compiled_in_timed_runs') or 0 for r in compiled)}.", ""] if compiled else []),
        *(["Methods that failed and are not in the table: " + "; ".join(
            f"{k} ({v['error'] if isinstance(v, dict) else v})" for k, v in errors.items()), ""] if errors else []),
        markdown_table(report), "",
        "Where the round time goes (SD/SSD, means per round):", "",
        phase_table(report), "",
        "Notes:", "",
        *[f"- {n}" for n in report["notes"]], "",
    ]
    return "\n".join(parts)


def _save(fig, ax, path: Path) -> str:
    """Legend, layout, PNG, close: the same ending for every plot. Returns the file name."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write_plots(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    res, samples = report["results"], report["samples"]
    tag = f"{report['models'].get('pair', '')}".split(":")[0].split(" (")[0]

    # 1. speedup over plain by method and prompt category (decode tok/s per category, b=1, first T, per setting)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    keys = sorted({(s["setting"], s["temperature"]) for s in samples if s["batch_size"] == min(
        x["batch_size"] for x in samples)})
    keys.sort(key=lambda k: (k[0] != "paper", k))  # the paper's setting first: it is the headline comparison
    setting, temp = keys[0] if keys else (None, None)
    b0 = min((s["batch_size"] for s in samples), default=1)
    sel = [s for s in samples if s["setting"] == setting and s["temperature"] == temp and s["batch_size"] == b0]
    cats = sorted({s["category"] for s in sel})
    methods = [m for m in report["methods"] if m != "plain" and any(s["method"] == m for s in sel)]

    def mean_tps(ms, cat):
        xs = [s for s in sel if s["method"] == ms and s["category"] == cat]
        tok = sum(s["new_tokens"] for s in xs)
        t = sum(s["wall_s"] for s in xs)
        return tok / t if t else None

    width = 0.8 / max(1, len(methods))
    for i, meth in enumerate(methods):
        ys = []
        for c in cats:
            p, v = mean_tps("plain", c), mean_tps(meth, c)
            ys.append(v / p if p and v else 0.0)
        ax.bar([j + i * width for j in range(len(cats))], ys, width, label=meth)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(cats))], cats)
    ax.set_ylabel("speedup over plain (end-to-end tok/s)")
    ax.set_title(f"{tag}: speedup by method and prompt category\n(setting={setting}, T={temp}, batch={b0})",
                 fontsize=10)
    written.append(_save(fig, ax, out / PLOTS[0]))

    # 2. tok/s vs batch size per method (first setting, T=first)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    s0 = res[0]["setting"] if res else None
    t0 = res[0]["temperature"] if res else None
    p0 = res[0].get("prompt_set") if res else None  # plots 2 and 3: the first prompt set
    for meth in report["methods"]:
        pts = sorted((r["batch_size"], r["tokens_per_s_decode"] or 0.0) for r in res
                     if r["method"] == meth and r["setting"] == s0 and r["temperature"] == t0
                     and r.get("prompt_set") == p0)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=meth)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s (all rows)")
    ax.set_title(f"{tag}: tokens/s vs batch size (setting={s0}, T={t0}, prompts={p0})")
    written.append(_save(fig, ax, out / PLOTS[1]))

    # 3. cache hit rate vs temperature (SSD methods)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for meth in [m for m in report["methods"] if m.startswith("ssd")]:
        for setting in sorted({r["setting"] for r in res}):
            pts = sorted((r["temperature"], r["hit_rate"]) for r in res if r["method"] == meth
                         and r["setting"] == setting and r["batch_size"] == b0 and r["hit_rate"] is not None
                         and r.get("prompt_set") == p0)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{meth} ({setting})")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("temperature")
    ax.set_ylabel("cache hit rate")
    ax.set_title(f"{tag}: SSD cache hit rate vs temperature (batch={b0}, prompts={p0})")
    written.append(_save(fig, ax, out / PLOTS[2]))
    return written


def write_report(report: dict[str, Any], out_dir: str | os.PathLike, plots: bool = True) -> dict[str, str]:
    """Write bench.json, table.md and the PNG plots into out_dir; returns {kind: path}."""
    finalize(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "bench.json"), "table": str(out / "table.md")}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1, default=str)
    (out / "table.md").write_text(markdown(report))
    if plots:
        for name in write_plots(report, out):
            paths[name] = str(out / name)
    return paths
