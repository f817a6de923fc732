"""The benchmark loop: settings × temperatures × batch sizes × methods over the same prompt batches.

Methods (all on the same prompts, same max_new_tokens, same sampling settings):
  plain                 target.generate() alone, eager, dynamic cache
  plain:static-compile  target.generate() on transformers' compiled fast path: cache_implementation="static" plus a
                        compile_config (the decode step runs under torch.compile); compiled during the warm-up
  hf:<sched>            transformers' own assisted generation (batch 1 only), one entry per draft schedule
  hf:prompt-lookup      transformers' prompt lookup decoding (prompt_lookup_num_tokens=K; no draft model; batch 1)
  sd                    our synchronous speculative decoding (generate(..., ssd=True, ssd_mode="sync"))
  ssd:<worker>          SSD / Saguaro with each worker kind the engine provides (found at run time)

Every method is warmed up, then the methods of each (setting, temperature, batch, prompt set) are timed interleaved
(bench/interleave.py), `repeats` passes over all its prompt batches; tokens/s are reported as the median over the
repeats with the min-max spread.

Thread settings (CPU):
  paper  the target gets 1 thread in every method; SSD with a parallel worker adds a 2nd core for the draft
         (target_threads=1, draft_threads=1). Inline SSD runs target and draft on the one thread.
  equal  equal total hardware: every method may use both cores (torch.set_num_threads(2)); a parallel SSD worker
         splits them (target_threads/draft_threads, default 1+1, overridable).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from hf_ssd.hf.plain_hand_off import static_compile_config
from hf_ssd.tools.bench.aggregate import add_speedups
from hf_ssd.tools.bench.interleave import run_group, warmups
from hf_ssd.tools.bench.probes import FirstTokenTimer, PeakRSS, machine_info, versions
from hf_ssd.tools.bench.workload import load_bench_prompts, load_models, new_tokens

SETTINGS = ("paper", "equal")

# transformers' assisted-generation schedules, set on the draft's generation_config before each call.
# "default" is transformers' own default (20 tokens, constant, confidence threshold 0.4).
HF_SCHEDULES: dict[str, dict[str, Any]] = {
    "constant": {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0},  # K each round
    "heuristic": {"num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.0},
    "default": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.4},
}
_HF_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")

# --methods entries: the four families (hf = every schedule in hf_schedules, ssd = every available worker) plus
# single methods. The two baselines a user might pick instead of speculative decoding are optional: when one fails
# (say torch.compile on an unsupported machine) the error goes into the report and the bench carries on.
METHOD_FAMILIES = ("plain", "hf", "sd", "ssd", "auto")
OPTIONAL_METHODS = ("plain:static-compile", "hf:prompt-lookup")
SD_UNPACKED = "sd:unpacked"  # our SD with ssd_packed_linear=False (not in the default set)
DEFAULT_METHODS = ("plain", "plain:static-compile", "hf", "hf:prompt-lookup", "sd", "ssd", "auto")
# ssd=True after `hf_ssd.warmup(target, draft, draft_process=True)`, as a server would start: the kept draft process
# is up before the first call. Not beside "auto": once up, that process serves every ssd=True row of the run.
AUTO_WARMUP = "auto:warmup"
WORKLOADS = ("default", "overhead")


@dataclass
class BenchConfig:
    pair: str | None = "default"  # assets pair name; ignored when target/draft paths or tiny are given
    target: str | None = None  # local model dir (from_pretrained)
    draft: str | None = None
    tiny: bool = False  # random tiny models from a config (CI)
    workload: str = "default"  # default: the pair above; overhead: bench/overhead.py's launch-bound stand-in
    alpha_noise: float = 0.0  # overhead workload: noise on the draft's weights (0: draft = target, α = 1)
    dtype: str = "float32"  # float32 keeps greedy exactness checks meaningful (bf16 flips an argmax now and then)
    prompts: tuple[str, ...] = ("humaneval",)
    num_prompts: int = 2
    max_prompt_tokens: int = 512
    max_new_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1,)
    temperatures: tuple[float, ...] = (0.0,)
    settings: tuple[str, ...] = ("paper",)
    K: int | tuple[int, ...] = 4  # several: one row per K for every method that drafts a fixed K (names "@K3")
    budget: int | tuple[int, ...] | None = None  # SSD rows; several: one row per budget ("@K3b16"); None: measured
    downweight: float = 1.0
    draft_quantize: str | None = None  # "int8": every method that drafts uses the int8 copy of the draft
    target_threads: int | None = None  # parallel SSD workers only (default 1)
    draft_threads: int | None = None
    hf_schedules: tuple[str, ...] = ("constant", "heuristic", "default")
    methods: tuple[str, ...] = DEFAULT_METHODS
    workers: tuple[str, ...] | None = None  # None: every worker kind the engine provides
    compile: str = "off"  # our SD/SSD rows: "off" (eager), "on" (ssd_compile + ssd_compile_target) or "both"
    warmup: int = 1  # untimed generations per unit before timing (plain:static-compile: at least 1, until compiled)
    repeats: int = 3  # timed passes over every prompt batch; tok/s = median over them, with min and max
    seed: int = 0
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @property
    def K_values(self) -> tuple[int, ...]:
        return tuple(self.K) if isinstance(self.K, (tuple, list)) else (self.K,)

    @property
    def budget_values(self) -> tuple[int | None, ...]:
        return tuple(self.budget) if isinstance(self.budget, (tuple, list)) else (self.budget,)


@dataclass(frozen=True)
class Method:
    name: str  # plain | plain:static-compile | hf:<schedule> | hf:prompt-lookup | sd | ssd:<worker> | ssd:auto
    kind: str  # plain | hf | sd | ssd | auto (generate(..., ssd=True) with no option: the controller decides)
    option: str | None = None  # static-compile, schedule, prompt-lookup or worker
    engine_compiled: bool = False  # our SD/SSD with ssd_compile + ssd_compile_target (name ends in "+compile")
    K: int | None = None  # draft tokens a round (sd, ssd, hf:constant/heuristic/prompt-lookup); None: not fixed
    budget: int | None = None  # SSD branches per row; None: the engine measures it

    @property
    def batch1_only(self) -> bool:
        return self.kind == "hf"  # transformers' assisted generation (prompt lookup too) is batch 1 only

    @property
    def compiled(self) -> bool:
        return self.option == "static-compile" or self.engine_compiled


# ---------------------------------------------------------------------------------------------------------------
# measurement helpers


def available_workers(target, draft, requested: tuple[str, ...] | None = None) -> tuple[list[str], dict[str, str]]:
    """Worker kinds that really run: each is tried on a 4-token prompt; a NotImplementedError (or a run whose
    stats report another worker) skips it. Returns (available, {skipped kind: reason})."""
    import hf_ssd  # noqa: F401  (enables ssd=True)
    from hf_ssd.config import WORKERS

    kinds = [w for w in WORKERS if w != "auto"]
    if requested:
        kinds = [w for w in kinds if w in requested]
    ok, skipped = [], {}
    vocab = target.config.get_text_config().vocab_size
    ids = torch.arange(3, 7, dtype=torch.long).remainder(vocab).unsqueeze(0)
    pad = target.generation_config.pad_token_id
    for w in kinds:
        try:
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, ssd=True,
                                  ssd_mode="ssd", ssd_worker=w, ssd_num_draft_tokens=2, ssd_budget=3,
                                  ssd_draft_quantize=None,
                                  max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                                  pad_token_id=pad)
        except NotImplementedError as e:
            skipped[w] = f"NotImplementedError: {e}"
            continue
        except Exception as e:  # a worker that exists but fails is reported, not benchmarked
            skipped[w] = f"{type(e).__name__}: {e}"
            continue
        got = (out.ssd_stats or {}).get("worker")
        if got != w:
            skipped[w] = f"engine ran worker {got!r} instead"
            continue
        ok.append(w)
    return ok, skipped


def threads_for(setting: str, method: Method, cfg: BenchConfig) -> dict[str, int | None]:
    """torch threads for the call, and the SSD side threads for parallel workers."""
    cores = os.cpu_count() or 2
    parallel = method.kind == "ssd" and method.option in ("thread", "process")
    if setting == "paper":
        return {"torch": 1, "target": 1 if parallel else None, "draft": 1 if parallel else None}
    both = min(2, cores)
    if parallel:
        t = cfg.target_threads or max(1, both // 2)
        d = cfg.draft_threads or max(1, both - t)
        return {"torch": t, "target": t, "draft": d}
    return {"torch": both, "target": None, "draft": None}


def _set_hf_schedule(draft, name: str, K: int) -> dict[str, Any]:
    gc = draft.generation_config
    saved = {k: getattr(gc, k, None) for k in _HF_KEYS}
    params = {"num_assistant_tokens": K, **HF_SCHEDULES[name]}
    for k, v in params.items():
        setattr(gc, k, v)
    return saved


def generate_once(method: Method, target, draft, ids, mask, *, cfg: BenchConfig, setting: str, temperature: float,
                  pad_id: int, eos_ids: set[int], max_new_tokens: int | None = None, process=None,
                  seed: int | None = None) -> dict[str, Any]:
    """One timed generation; returns tokens per row, wall/ttft seconds, ssd_stats, peak RSS.
    `process`: the run's kept DraftProcess, used by the process worker so its start-up is never timed. `seed`: the
    torch seed before generating (default cfg.seed)."""
    import hf_ssd  # noqa: F401
    from transformers import StoppingCriteriaList

    th = threads_for(setting, method, cfg)
    torch.set_num_threads(th["torch"])
    timer = FirstTokenTimer()
    kw: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=max_new_tokens or cfg.max_new_tokens, pad_token_id=pad_id,
                              stopping_criteria=StoppingCriteriaList([timer]), return_dict_in_generate=True)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    saved = None
    if method.option == "static-compile":
        kw.update(cache_implementation="static", compile_config=static_compile_config(target))
    elif method.kind == "hf" and method.option == "prompt-lookup":
        kw["prompt_lookup_num_tokens"] = method.K
    elif method.kind == "hf":
        saved = _set_hf_schedule(draft, method.option, method.K or cfg.K_values[0])
        kw["assistant_model"] = draft
    elif method.kind == "auto":
        kw.update(assistant_model=draft, ssd=True)
        if cfg.draft_quantize is not None:  # the bench quantized the draft already
            kw["ssd_draft_quantize"] = None
    elif method.kind in ("sd", "ssd"):
        # ssd_draft_quantize=None: the draft exactly as every other method gets it (the bench applied
        # cfg.draft_quantize to it already), not the engine's own "auto" int8 choice
        kw.update(assistant_model=draft, ssd=True, ssd_mode="sync" if method.kind == "sd" else "ssd",
                  ssd_num_draft_tokens=method.K, ssd_draft_quantize=None)
        if method.option == "unpacked":
            kw["ssd_packed_linear"] = False
        if method.kind == "ssd":
            kept = process if method.option == "process" else None
            kw.update(ssd_worker=kept or method.option, ssd_downweight=cfg.downweight)
            if method.budget is not None:
                kw["ssd_budget"] = method.budget
            if th["target"] is not None:
                kw.update(ssd_target_threads=th["target"], ssd_draft_threads=th["draft"])
    if method.engine_compiled:  # static caches on both sides, fixed-width forwards compiled
        kw.update(ssd_compile=True, ssd_compile_target=True)
    torch.manual_seed(cfg.seed if seed is None else seed)
    try:
        with PeakRSS() as mem, torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(ids, **kw)
            wall = time.perf_counter() - start
    finally:
        if saved is not None:
            for k, v in saved.items():
                setattr(draft.generation_config, k, v)
    toks = new_tokens(out.sequences, ids.shape[1], eos_ids)
    ttft = (timer.first - start) if timer.first is not None else wall
    return {"tokens": toks, "wall_s": wall, "ttft_s": min(ttft, wall), "peak_rss_bytes": mem.peak,
            "rss_source": mem.source, "ssd_stats": getattr(out, "ssd_stats", None), "threads": th}


# ---------------------------------------------------------------------------------------------------------------
# the loop


def plan_methods(cfg: BenchConfig, workers: list[str]) -> list[Method]:
    """cfg.methods -> Methods in table order: plain, plain:static-compile, hf schedules, hf:prompt-lookup, sd, ssd.
    'hf' = every schedule in cfg.hf_schedules ('hf:<schedule>' names one), 'ssd' = every available worker.
    Several K (and budgets): one row of each method that drafts a fixed K per K (SSD: per K and budget), named
    "sd@K3", "ssd:process+compile@K3b16", so each method can be compared at its best K in one run."""
    known = {*METHOD_FAMILIES, *OPTIONAL_METHODS, AUTO_WARMUP, SD_UNPACKED, *(f"hf:{s}" for s in HF_SCHEDULES)}
    unknown = [m for m in cfg.methods if m not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {sorted(known)}")
    if "auto" in cfg.methods and AUTO_WARMUP in cfg.methods:
        raise ValueError(f"'auto' and '{AUTO_WARMUP}' cannot run in one bench: the draft process the second starts "
                         "would serve the first's calls too; run them in two benches")
    Ks, budgets = cfg.K_values, cfg.budget_values
    sweep_K, sweep_budget = len(Ks) > 1, len(budgets) > 1

    def per_K(name: str, kind: str, option: str | None = None, compiled: bool = False,
              with_budget: bool = False) -> list[Method]:
        out = []
        for K in Ks:
            for b in (budgets if with_budget else (None,)):
                tag = (f"K{K}" if sweep_K else "") + (f"b{b}" if with_budget and sweep_budget else "")
                out.append(Method(name + (f"@{tag}" if tag else ""), kind, option, compiled, K, b))
        return out

    ms: list[Method] = []
    if "plain" in cfg.methods:
        ms.append(Method("plain", "plain"))
    if "plain:static-compile" in cfg.methods:
        ms.append(Method("plain:static-compile", "plain", "static-compile"))
    scheds = list(cfg.hf_schedules) if "hf" in cfg.methods else []
    scheds += [s for s in HF_SCHEDULES if f"hf:{s}" in cfg.methods and s not in scheds]
    for s in scheds:  # "default" sets its own 20 tokens: K does not apply
        ms += [Method(f"hf:{s}", "hf", s)] if "num_assistant_tokens" in HF_SCHEDULES[s] else per_K(f"hf:{s}", "hf", s)
    if "hf:prompt-lookup" in cfg.methods:
        ms += per_K("hf:prompt-lookup", "hf", "prompt-lookup")
    variants = {"off": (False,), "on": (True,), "both": (False, True)}[cfg.compile]
    suffix = {False: "", True: "+compile"}
    if "sd" in cfg.methods:
        ms += [m for c in variants for m in per_K("sd" + suffix[c], "sd", compiled=c)]
    if SD_UNPACKED in cfg.methods:  # the same SD with torch's own GEMM: what the packed linear kernel adds
        ms += [m for c in variants for m in per_K(SD_UNPACKED + suffix[c], "sd", "unpacked", compiled=c)]
    if "ssd" in cfg.methods:
        ms += [m for c in variants for w in workers for m in per_K(f"ssd:{w}" + suffix[c], "ssd", w, c, True)]
    if "auto" in cfg.methods:  # +compile: ssd=True plus the two compile options; the controller still decides
        ms += [Method("ssd:auto" + suffix[c], "auto", engine_compiled=c) for c in variants]
    if AUTO_WARMUP in cfg.methods:
        ms += [Method("ssd:auto+warmup" + suffix[c], "auto", "warmup", engine_compiled=c) for c in variants]
    return ms


def run_bench(cfg: BenchConfig, models=None, command: str | None = None) -> dict[str, Any]:
    """Run every method on the same prompt batches; return the report dict (see report.validate_report)."""
    import hf_ssd  # noqa: F401

    t_start = time.perf_counter()
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    for s in cfg.settings:
        if s not in SETTINGS:
            raise ValueError(f"unknown setting {s!r}; choose from {SETTINGS}")
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {cfg.workload!r}; choose from {WORKLOADS}")
    if cfg.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {cfg.repeats}")
    plan_methods(cfg, [])  # unknown method names fail before any model loads
    target, draft, tok, model_info = models if models is not None else load_models(cfg)
    if cfg.draft_quantize:
        from hf_ssd.draft.quant import quantized_draft

        draft = quantized_draft(draft, cfg.draft_quantize)
        model_info = {**model_info, "draft_quantize": cfg.draft_quantize}
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    prompts = load_bench_prompts(cfg, tok)
    workers, skipped = available_workers(target, draft, cfg.workers) if "ssd" in cfg.methods else ([], {})
    methods = plan_methods(cfg, workers)
    process = None
    if "process" in workers:  # one kept draft process for all runs: its start-up is not part of any timing
        from hf_ssd.workers.process import DraftProcess

        process = DraftProcess(draft)
    try:
        return _run_units(cfg, command, target, draft, tok, model_info, prompts, workers, skipped, methods, pad_id,
                          eos_ids, t_start, load_at_start, process)
    finally:
        if process is not None:
            process.close()


def _run_units(cfg, command, target, draft, tok, model_info, prompts, workers, skipped, methods, pad_id, eos_ids,
               t_start, load_at_start, process) -> dict[str, Any]:
    from tqdm.auto import tqdm

    prompt_sets = list(dict.fromkeys(p["set"] for p in prompts))  # each set reported on its own rows
    groups = []
    for setting in cfg.settings:
        for temp in cfg.temperatures:
            for b in cfg.batch_sizes:
                for ps in prompt_sets:
                    rows = [p for p in prompts if p["set"] == ps]
                    batches = [rows[i:i + b] for i in range(0, len(rows), b)]
                    ms = [m for m in methods if not (m.batch1_only and b > 1)]
                    groups.append((setting, temp, b, ps, ms, batches))
    total = sum(len(g[5]) * cfg.repeats + warmups(cfg, m) for g in groups for m in g[4])
    results, samples, errors = [], [], {}
    plain_out: dict[tuple, list[list[int]]] = {}
    bar = tqdm(total=total, desc="bench", unit="gen", disable=not cfg.progress)
    for setting, temp, b, ps, ms, batches in groups:
        rows, group_samples = run_group(setting, temp, b, ps, ms, batches, cfg=cfg, generate_once=generate_once,
                                        target=target, draft=draft, pad_id=pad_id, eos_ids=eos_ids,
                                        process=process, bar=bar, plain_out=plain_out, errors=errors,
                                        optional=OPTIONAL_METHODS)
        results += rows
        samples += group_samples
    bar.close()
    add_speedups(results)
    torch.set_num_threads(min(2, os.cpu_count() or 2))
    return {
        "schema_version": None,  # filled by report.finalize
        "command": command or " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": time.perf_counter() - t_start,
        "config": cfg.to_dict(),
        "workload": cfg.workload,
        "models": model_info,
        "versions": versions(),
        "machine": {**machine_info(), "load_avg_at_start": load_at_start},
        "workers": {"available": workers, "skipped": skipped},
        "methods": [m.name for m in methods],
        "method_errors": errors,
        "prompt_sets": prompt_sets,
        "prompts": [{k: p[k] for k in ("id", "set", "category")} | {"tokens": len(p["input_ids"])} for p in prompts],
        "results": results,
        "samples": samples,
        "notes": NOTES,
    }


NOTES = [
    "tokens_per_s_e2e = new tokens / wall time of generate() (prefill included); tokens_per_s_decode = "
    "(new tokens - 1 per row) / (wall - time to first token). For SD/SSD the first token comes out of the first "
    "verify round, so its drafting is counted in the time to first token.",
    "Each (setting, temperature, batch, prompt set, method) is warmed up untimed (torch.compile happens there); "
    "then the methods of a (setting, temperature, batch, prompt set) group are timed interleaved: for each of "
    "`repeats` passes and each prompt batch, every method runs once, back to back, in an order rotating with the "
    "pass, so the machine's drift hits them alike. tokens/s = median over the repeats, with min-max in *_stats "
    "(JSON) and in brackets (Markdown). Pass r seeds torch with seed + r for every method, so at T > 0 each pass "
    "times a new sample of every prompt (before 2026-12-02 every pass drew the same sample).",
    "speedup_vs_* compare median decode tokens/s within the same setting, temperature, batch size and prompt set "
    "(_e2e: end-to-end). plain = eager plain generate(); best_plain = the faster of plain and plain:static-compile; "
    "sd = our synchronous SD at its best compile setting (the faster of sd and sd+compile); "
    "hf_best = the fastest transformers speculative method of that group (assisted-generation schedules and prompt "
    "lookup; batch 1 only).",
    "alpha_est: per-token acceptance α = accepted drafts / (accepted drafts + rounds with a rejected draft), the "
    "capped-geometric estimate whatever K each round used (a property of the model pair, not of timing). Read it off "
    "the sd row: SSD rows also count rounds the engine's backup speculator (e.g. n-gram) served after a cache miss.",
    "fraction_of_round_limit = decode tokens/s / (batch x mean tokens per round / mean verify time).",
    "greedy_equal: per-row tokens identical to plain generate() in the same setting and batch (T=0 only).",
    "paper setting: target on 1 thread in every method; parallel SSD workers add 1 draft thread. equal: every "
    "method may use both cores.",
    "peak_rss_mb: peak resident memory of the whole process while the method ran (both models included).",
    "ssd:auto rows: controller_choice is the plan the last timed call ended on, controller_ended_on counts them over "
    "every timed call; each sample's `controller` keeps that call's own record (the plan it ended on, its first "
    "decision's reason and top 3 predictions, its switches).",
    "ssd:auto rows learn alone: the controller keeps what it measures per set of constraining options, so the "
    "hand-picked sd/ssd rows teach it nothing (since 2026-12-03). What the process shares with them is physical: "
    "compiled graphs (the static caches' in this process, not those of the sd/ssd rows' own draft process) and "
    "transformers' compiled plain loop that the plain:static-compile row's warm-up builds, which an "
    "ssd:auto+compile call that hands off to plain reuses.",
]
