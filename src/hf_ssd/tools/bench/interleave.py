"""Timing the methods of one group side by side.

A group is every method on one (setting, temperature, batch size, prompt set). Each method is warmed up untimed
first (first-call allocations, budget measurement, thread pools, torch.compile, a kept draft process). Then the
timed calls interleave: for each repeat and each prompt batch, every method runs once, back to back, in an order
that rotates with the repeat. A small machine's speed drifts by tens of percent over minutes; timed back to back,
the methods of a group share that drift, so the ratios between them do not carry it (timed one method after the
other, minutes apart, they did).
"""
from __future__ import annotations

import sys
import time
from typing import Any

from hf_ssd.hf.plain_hand_off import compiled_graphs
from hf_ssd.testing import left_pad
from hf_ssd.tools.bench.aggregate import aggregate_repeats, greedy_equal, safe_div


def warmups(cfg, m) -> int:
    """Untimed generations before a method's timing: cfg.warmup, and at least one for a compiled method (its first
    call compiles; more follow while a warm-up still builds new graphs, up to 3 extra)."""
    return max(cfg.warmup, 1) if m.compiled else cfg.warmup


def rotated(items: list, k: int) -> list:
    """items with the first k % len moved to the end: repeat r runs method r first, so no method always follows
    the same one (a method that leaves the caches cold, or a process busy, does not always slow the same next)."""
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]


def run_group(setting, temp, b, ps, methods, batches, *, cfg, generate_once, target, draft, pad_id, eos_ids, process,
              bar, plain_out, errors, optional) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Warm every method up, then time them interleaved; returns (one result row per method, samples).
    A method in `optional` that raises is left out with its error in `errors`; any other raises."""
    def gen_for(m):
        def gen(batch, max_new_tokens=None, seed=None):
            ids, mask = left_pad([p["input_ids"] for p in batch], pad=pad_id)
            return generate_once(m, target, draft, ids, mask, cfg=cfg, setting=setting, temperature=temp,
                                 pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=max_new_tokens, process=process,
                                 seed=seed)
        return gen

    def drop(m, exc: Exception) -> None:
        if m.name not in optional:
            raise exc
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        errors[m.name] = {"setting": setting, "temperature": temp, "batch_size": b, "prompt_set": ps,
                          "error": msg[:2000]}
        print(f"warning: {m.name} failed and is left out of the report: {msg[:300]}", file=sys.stderr)

    live, gens, warm_s = [], {}, {}
    for m in methods:
        bar.set_postfix_str(f"{setting} T={temp} b={b} {ps} {m.name} (warm-up)")
        if m.name in errors:  # an optional baseline that failed once is not retried
            bar.update(len(batches) * cfg.repeats + warmups(cfg, m))
            continue
        gens[m.name] = gen_for(m)
        try:
            warm_s[m.name] = _warm_up(m, batches, gens[m.name], cfg, target, draft, bar)
        except Exception as exc:  # noqa: BLE001 - drop() re-raises what is not optional
            drop(m, exc)
            bar.update(len(batches) * cfg.repeats)
            continue
        live.append(m)

    per_rep = {m.name: [[] for _ in range(cfg.repeats)] for m in live}
    graphs = {m.name: 0 for m in live}
    samples: dict[str, list] = {m.name: [] for m in live}
    eqs: dict[str, list] = {m.name: [] for m in live}
    bar.set_postfix_str(f"{setting} T={temp} b={b} {ps} (timed, {len(live)} methods interleaved)")
    for rep in range(cfg.repeats):  # repeats outermost: a slow spell of the machine hits one repeat, not one batch
        for bi, batch in enumerate(batches):
            # plain first on the first pass, so the greedy reference exists for every other method
            for m in rotated(live, rep):
                if m not in live:
                    continue  # an optional method that failed in this pass
                before = compiled_graphs() if m.compiled else 0
                try:
                    # one seed per pass, the same for every method: sampled runs then time a new sample of each
                    # prompt in each pass (one sample timed three times measured the clock, not the method)
                    r = gens[m.name](batch, seed=cfg.seed + rep)
                except Exception as exc:  # noqa: BLE001
                    drop(m, exc)
                    live.remove(m)
                    continue
                if m.compiled:
                    graphs[m.name] += compiled_graphs() - before
                bar.update()
                eq = _greedy_check(m, r, temp, rep, (setting, temp, b, ps, bi), plain_out)
                eqs[m.name].append(eq)
                per_rep[m.name][rep].append(r)
                samples[m.name].append(_sample(setting, temp, b, ps, m, bi, rep, batch, r, eq))
    rows = [_row(setting, temp, b, ps, m, cfg, per_rep[m.name], eqs[m.name], warm_s[m.name], graphs[m.name])
            for m in live]
    return rows, [s for m in live for s in samples[m.name]]


def _warm_up(m, batches, generate, cfg, target, draft, bar) -> float:
    """The untimed calls before a method's timing; returns their seconds."""
    t0, graphs = time.perf_counter(), compiled_graphs() if m.compiled else 0
    if m.kind == "auto" and m.option == "warmup":  # what a server runs once before its first ssd=True call
        import hf_ssd

        hf_ssd.warmup(target, draft, draft_process=True, progress=False)
    last = None  # the latest warm-up call's result: whether it still compiled for free

    def gen(batch, max_new_tokens=None):
        nonlocal last
        last = generate(batch, max_new_tokens=max_new_tokens)
        return last

    n_warm = warmups(cfg, m)
    for w in range(n_warm + (3 if m.compiled else 0)):
        if w >= n_warm:  # compiled method: one more warm-up only while the last one still compiled something
            if compiled_graphs() == graphs:
                break
        graphs = compiled_graphs() if m.compiled else 0
        gen(batches[w % len(batches)], max_new_tokens=min(8, cfg.max_new_tokens))
        if w < n_warm:
            bar.update()
    if m.engine_compiled:
        # Our static caches are sized per prompt length bucket and max_length: full-length passes over every batch
        # (more only while a pass still builds graphs), so no shape is first met while timed.
        for _ in range(3):
            before = compiled_graphs()
            for batch in batches:
                gen(batch)
            if compiled_graphs() == before:
                break
    if m.kind == "auto" and m.compiled:
        # the controller's first calls of a setting compile whatever plan they try (control.compiled, the warm-up a
        # user opts into with ssd_compile): at batch 16 one prompt batch left the last of them timed, and one
        # compiled an int8 draft's graphs there (24 tok/s against ~600). Warm-up calls until one says it was the
        # last free one (calls that explore do not count: control.compiled.compiling_free).
        from hf_ssd.control.compiled import COMPILE_FREE_MAX_CALLS

        for w in range(COMPILE_FREE_MAX_CALLS):
            if not _compiling_free(last):
                break
            gen(batches[w % len(batches)])
    if m.kind == "auto":
        from hf_ssd.workers import pool

        if pool.wait(draft) == "ready":
            # the controller asked for a kept draft process while warming up: a user's later calls run with it up,
            # so the timed ones do too, after a pass that lets the controller try (and compile) its process plans
            for batch in batches:
                gen(batch)
    return time.perf_counter() - t0


def _compiling_free(result) -> bool:
    """Did the call that returned `result` compile for free (one of its setting's first calls), or is that
    unknown (no call yet, no controller record)? Then the next call may too."""
    controller = ((result or {}).get("ssd_stats") or {}).get("controller") or {}
    return controller.get("compiling_free", True)


def _greedy_check(m, r, temp, rep, key, plain_out) -> bool | None:
    """Whether this run's tokens equal eager plain's on the same batch (T = 0 only; None where there is no
    reference)."""
    if temp != 0:
        return None
    if m.kind == "plain" and rep == 0 and key not in plain_out:  # eager plain when it ran (it runs first)
        plain_out[key] = r["tokens"]
    if key not in plain_out:
        return None
    return greedy_equal(r["tokens"], plain_out[key])[0]


def _sample(setting, temp, b, ps, m, bi, rep, batch, r, eq) -> dict[str, Any]:
    cats = sorted({p["category"] for p in batch})
    n_new = sum(len(t) for t in r["tokens"])
    stats = r["ssd_stats"] or {}  # none for plain decoding
    sample = {
        "setting": setting, "temperature": temp, "batch_size": b, "method": m.name, "batch_index": bi,
        "repeat": rep, "prompt_ids": [p["id"] for p in batch],
        "category": cats[0] if len(cats) == 1 else "mixed", "prompt_set": ps, "new_tokens": n_new,
        "wall_s": r["wall_s"], "ttft_s": r["ttft_s"], "tokens_per_s_e2e": safe_div(n_new, r["wall_s"]),
        "tokens_per_s_decode": safe_div(n_new - len(r["tokens"]), r["wall_s"] - r["ttft_s"]),
        "hit_rate": stats.get("hit_rate"),
        "mean_tokens_per_round": stats.get("mean_tokens_per_round"),
        # which backup served the rounds after a cache miss, per call: a miss served by the n-gram lookup commits far
        # less than one the draft serves, and the result row only keeps the sum over every call of every plan
        "backup_rounds": stats.get("backup_rounds"),
        "greedy_equal": eq, "threads": r["threads"],
    }
    control = stats.get("controller")
    if control:  # ssd:auto: this call's plans, and why it started on the first (the result row keeps only the last)
        sample["controller"] = _call_record(control)
    return sample


def _call_record(control: dict[str, Any]) -> dict[str, Any]:
    """One call's controller record, small enough to keep per sample: the plan it ended on, its first decision's
    reason and top predictions, and its switches."""
    return {"ended_on": control.get("choice"), "first_reason": control.get("reason"),
            "predicted": (control.get("predicted") or [])[:6],
            "switches": [f"round {sw.get('round')}: {sw.get('from')} -> {sw.get('to')}"
                         for sw in control.get("switches") or []]}


def _row(setting, temp, b, ps, m, cfg, per_rep, eqs, warmup_s, graphs) -> dict[str, Any]:
    """One method's result row: medians over the repeats, with its greedy check and what the controller ran."""
    agg = aggregate_repeats(per_rep, b)
    agg["greedy_equal"] = None if temp != 0 or any(e is None for e in eqs) else all(eqs)
    agg["greedy_equal_runs"] = None if agg["greedy_equal"] is None else f"{sum(eqs)}/{len(eqs)}"
    agg["warmup_s"] = warmup_s
    if m.compiled:  # > 0 would mean compilation was timed: say so rather than hide it
        agg["graphs_compiled_in_timed_runs"] = graphs
    last = per_rep[-1][-1] if per_rep and per_rep[-1] else None
    row = {"setting": setting, "temperature": temp, "batch_size": b, "prompt_set": ps, "method": m.name,
           "kind": m.kind, "option": m.option, "engine_compiled": m.engine_compiled, "K": m.K,
           "threads": last["threads"] if last else None, **agg}
    if m.kind == "auto":  # what the controller ran (last timed run) and why: the row's result depends on it
        control = ((last or {}).get("ssd_stats") or {}).get("controller") or {}
        row["controller_choice"] = control.get("choice")
        row["controller_reason"] = control.get("reason")
        row["controller_switches"] = len(control.get("switches") or [])
        row.update(_controller_record([r for runs in per_rep for r in runs]))
    return row


def _controller_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every timed run of an auto row: how many calls ended on each plan, and each distinct switch
    (from -> to) with the first reason given for it."""
    ended: dict[str, int] = {}
    switches: dict[str, str] = {}
    for r in runs:
        control = (r.get("ssd_stats") or {}).get("controller") or {}
        if control.get("choice"):
            ended[control["choice"]] = ended.get(control["choice"], 0) + 1
        for sw in control.get("switches") or []:
            switches.setdefault(f"{sw.get('from')} -> {sw.get('to')}", sw.get("reason"))
    return {"controller_ended_on": ended, "controller_switch_reasons": switches}
