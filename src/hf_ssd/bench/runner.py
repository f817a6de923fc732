"""The benchmark loop: settings × temperatures × batch sizes × methods over the same prompt batches.

Methods (all on the same prompts, same max_new_tokens, same sampling settings):
  plain        target.generate() alone
  hf:<sched>   transformers' own assisted generation (batch 1 only), one entry per draft schedule
  sd           our synchronous speculative decoding (generate(..., ssd=True, ssd_mode="sync"))
  ssd:<worker> SSD / Saguaro with each worker kind the engine provides (found at run time)

Thread settings (CPU):
  paper  the target gets 1 thread in every method; SSD with a parallel worker adds a 2nd core for the draft
         (target_threads=1, draft_threads=1). Inline SSD runs target and draft on the one thread.
  equal  equal total hardware: every method may use both cores (torch.set_num_threads(2)); a parallel SSD worker
         splits them (target_threads/draft_threads, default 1+1, overridable).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

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


@dataclass
class BenchConfig:
    pair: str | None = "default"  # assets pair name; ignored when target/draft paths or tiny are given
    target: str | None = None  # local model dir (from_pretrained)
    draft: str | None = None
    tiny: bool = False  # random tiny models from a config (CI)
    dtype: str = "float32"  # float32 keeps greedy exactness checks meaningful (bf16 flips an argmax now and then)
    prompts: tuple[str, ...] = ("humaneval",)
    num_prompts: int = 2
    max_prompt_tokens: int = 512
    max_new_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1,)
    temperatures: tuple[float, ...] = (0.0,)
    settings: tuple[str, ...] = ("paper",)
    K: int = 4
    budget: int | None = None
    downweight: float = 1.0
    draft_quantize: str | None = None  # "int8": every method that drafts uses the int8 copy of the draft
    target_threads: int | None = None  # parallel SSD workers only (default 1)
    draft_threads: int | None = None
    hf_schedules: tuple[str, ...] = ("constant", "heuristic", "default")
    methods: tuple[str, ...] = ("plain", "hf", "sd", "ssd")
    workers: tuple[str, ...] | None = None  # None: every worker kind the engine provides
    warmup: int = 1  # untimed generations per (setting, method) before timing
    repeats: int = 1
    seed: int = 0
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class Method:
    name: str  # plain | hf:<schedule> | sd | ssd:<worker>
    kind: str  # plain | hf | sd | ssd
    option: str | None = None  # schedule or worker

    @property
    def batch1_only(self) -> bool:
        return self.kind == "hf"


# ---------------------------------------------------------------------------------------------------------------
# models, tokenizers, prompts


class ByteTokenizer:
    """A toy byte-level tokenizer for the --tiny random models: id = byte + 2, 0 = pad, 1 = eos."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 1
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return [b + 2 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) - 2 for i in ids if int(i) >= 2).decode("utf-8", errors="replace")


def tiny_pair(seed: int = 0):
    """Random tiny Qwen2 target + a noisy copy as draft (partial agreement), float32, eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = ByteTokenizer()
    cfg = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen the random logits so greedy decoding has clear argmaxes
        target.lm_head.weight.mul_(8.0)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * (p.std() if p.numel() > 1 else 1.0))
    for m in (target, draft):
        m.generation_config.pad_token_id = tok.pad_token_id
        m.generation_config.eos_token_id = tok.eos_token_id
    return target, draft, tok


def load_models(cfg: BenchConfig):
    """(target, draft, tokenizer, description dict)."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.tiny:
        t, d, tok = tiny_pair(cfg.seed)
        return t, d, tok, {"pair": "tiny (random Qwen2, 2 layers, hidden 64, byte vocab)", "dtype": "float32"}
    if cfg.target or cfg.draft:
        if not (cfg.target and cfg.draft):
            raise ValueError("give both --target and --draft")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).eval()
        draft = AutoModelForCausalLM.from_pretrained(cfg.draft, dtype=dtype).eval()
        tok = AutoTokenizer.from_pretrained(cfg.target)
        return target, draft, tok, {"pair": f"{cfg.target} + {cfg.draft}", "dtype": cfg.dtype}
    from ..assets import PAIRS, load_default_pair, load_model

    if cfg.pair == "default":
        target, draft, tok = load_default_pair(dtype=dtype)
    else:
        spec = PAIRS[cfg.pair]
        if spec.draft is None:
            raise ValueError(f"pair {cfg.pair!r} has no draft model; use --pair default or --target/--draft")
        target, tok = load_model(spec.target, dtype)
        draft, _ = load_model(spec.draft, dtype)
    return target, draft, tok, {"pair": f"{cfg.pair}: {PAIRS[cfg.pair].description}", "dtype": cfg.dtype}


def load_bench_prompts(cfg: BenchConfig, tokenizer) -> list[dict[str, Any]]:
    """Prompts of every set as dicts id/set/category/prompt/input_ids (chat template applied, tokens capped)."""
    from ..prompts import format_chat, load_prompts

    rows = []
    for name in cfg.prompts:
        ds = load_prompts(name, cfg.num_prompts, seed=cfg.seed, max_chars=4000)
        for r in ds:
            text = format_chat(tokenizer, r["prompt"])
            ids = list(tokenizer.encode(text))
            if cfg.tiny:
                ids = ids[-min(cfg.max_prompt_tokens, 48):]  # keep CI runs to seconds
            else:
                ids = ids[-cfg.max_prompt_tokens:]
            rows.append({"id": r["id"], "set": name, "category": r["category"], "input_ids": ids})
    return rows


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(x) for x in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, n - len(x):] = torch.tensor(x, dtype=torch.long)
        mask[i, n - len(x):] = 1
    return ids, mask


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos_ids: set[int]) -> list[list[int]]:
    """Generated tokens per row, cut after the first EOS (padding after it dropped)."""
    out = []
    for row in sequences[:, prompt_len:].tolist():
        toks = []
        for t in row:
            toks.append(int(t))
            if int(t) in eos_ids:
                break
        out.append(toks)
    return out


# ---------------------------------------------------------------------------------------------------------------
# measurement helpers


class FirstTokenTimer:
    """A stopping criterion that never stops and notes when generation produced its first token (TTFT)."""

    def __init__(self):
        self.first: float | None = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.first is None:
            self.first = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class PeakRSS:
    """Peak resident memory of this process while the block runs (psutil sampling every 20 ms; falls back to
    resource.getrusage's lifetime peak when psutil is missing)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self.source = interval, 0, "psutil"
        try:
            import psutil

            self._proc = psutil.Process()
        except ImportError:
            self._proc = None
            self.source = "resource.ru_maxrss (process lifetime)"

    def _sample(self) -> int:
        if self._proc is not None:
            try:
                return self._proc.memory_info().rss
            except Exception:
                return 0
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def __enter__(self):
        self._stop = threading.Event()
        self.peak = self._sample()

        def loop():
            while not self._stop.wait(self.interval):
                self.peak = max(self.peak, self._sample())

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._sample())
        return False


_PROCESS: dict[str, Any] = {}  # the kept DraftProcess of a run, if the process worker is benchmarked


def available_workers(target, draft, requested: tuple[str, ...] | None = None) -> tuple[list[str], dict[str, str]]:
    """Worker kinds that really run: each is tried on a 4-token prompt; a NotImplementedError (or a run whose
    stats report another worker) skips it. Returns (available, {skipped kind: reason})."""
    import hf_ssd  # noqa: F401  (enables ssd=True)
    from ..config import WORKERS

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
                  pad_id: int, eos_ids: set[int], max_new_tokens: int | None = None) -> dict[str, Any]:
    """One timed generation; returns tokens per row, wall/ttft seconds, ssd_stats, peak RSS."""
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
    if method.kind == "hf":
        saved = _set_hf_schedule(draft, method.option, cfg.K)
        kw["assistant_model"] = draft
    elif method.kind in ("sd", "ssd"):
        kw.update(assistant_model=draft, ssd=True, ssd_mode="sync" if method.kind == "sd" else "ssd",
                  ssd_num_draft_tokens=cfg.K)
        if method.kind == "ssd":
            worker = _PROCESS.get("worker") if method.option == "process" else None
            kw.update(ssd_worker=worker or method.option, ssd_downweight=cfg.downweight)
            if cfg.budget is not None:
                kw["ssd_budget"] = cfg.budget
            if th["target"] is not None:
                kw.update(ssd_target_threads=th["target"], ssd_draft_threads=th["draft"])
    torch.manual_seed(cfg.seed)
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
# aggregation (pure arithmetic, unit-tested)


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
        for key in ("verify", "draft", "resolve", "round"):
            num = den = 0.0
            for s in stats:
                v = (s.get("phase_means_s") or {}).get(key)
                w = s.get("rounds") or 0
                if v is not None and w:
                    num, den = num + v * w, den + w
            phases[key] = num / den if den else None
        ov = [s["overlap_fraction"] for s in stats if s.get("overlap_fraction") is not None]
        out.update({
            "mean_tokens_per_round": safe_div(emitted, row_rounds),
            "mean_accepted_per_round": safe_div(sum(s["accepted"] for s in stats), row_rounds),
            "hit_rate": safe_div(sum(s["cache_hits"] for s in stats), lookups) if lookups else None,
            "rounds": rounds, "phase_means_s": phases,
            "overlap_fraction": sum(ov) / len(ov) if ov else None,
            "budget": stats[-1].get("budget"), "fallback_reason": next(
                (s["fallback_reason"] for s in stats if s.get("fallback_reason")), None),
            "backup_rounds": _sum_counts([s.get("backup_rounds") or {} for s in stats]),
        })
        limit = safe_div(batch * out["mean_tokens_per_round"], phases["verify"]) \
            if out["mean_tokens_per_round"] is not None else None
        out["round_limit_tps"] = limit
        out["fraction_of_round_limit"] = safe_div(out["tokens_per_s_decode"], limit)
    else:
        out.update({"mean_tokens_per_round": None, "mean_accepted_per_round": None, "hit_rate": None,
                    "round_limit_tps": None, "fraction_of_round_limit": None, "phase_means_s": None,
                    "overlap_fraction": None})
    return out


def _sum_counts(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[str(k)] = total.get(str(k), 0) + int(v)
    return total


def add_speedups(results: list[dict[str, Any]]) -> None:
    """speedup_vs_plain / _vs_hf_best / _vs_sd within each (setting, temperature, batch) group, on decode tok/s
    and on end-to-end tok/s (suffix _e2e). hf_best = the fastest transformers schedule of the group."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["temperature"], r["batch_size"]), []).append(r)
    for rs in groups.values():
        for metric, suffix in (("tokens_per_s_decode", ""), ("tokens_per_s_e2e", "_e2e")):
            by = {r["method"]: r[metric] for r in rs}
            hf = [v for m, v in by.items() if m.startswith("hf:") and v]
            refs = {"plain": by.get("plain"), "hf_best": max(hf) if hf else None, "sd": by.get("sd")}
            for r in rs:
                for ref, v in refs.items():
                    r[f"speedup_vs_{ref}{suffix}"] = safe_div(r[metric], v)


def greedy_equal(outputs: list[list[int]], reference: list[list[int]]) -> tuple[bool, int]:
    """(all equal, number of rows that differ) between a method's per-row tokens and plain's."""
    diff = sum(1 for a, b in zip(outputs, reference) if a != b) + abs(len(outputs) - len(reference))
    return diff == 0, diff


# ---------------------------------------------------------------------------------------------------------------
# the loop


def plan_methods(cfg: BenchConfig, workers: list[str]) -> list[Method]:
    ms: list[Method] = []
    if "plain" in cfg.methods:
        ms.append(Method("plain", "plain"))
    if "hf" in cfg.methods:
        ms += [Method(f"hf:{s}", "hf", s) for s in cfg.hf_schedules]
    if "sd" in cfg.methods:
        ms.append(Method("sd", "sd"))
    if "ssd" in cfg.methods:
        ms += [Method(f"ssd:{w}", "ssd", w) for w in workers]
    return ms


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    info["torch_threads_default"] = torch.get_num_threads()
    try:  # other processes on the same cores distort every timing: keep the load next to the numbers
        info["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for p in ("hf-ssd", "torch", "transformers", "accelerate", "datasets", "numpy", "matplotlib", "tqdm"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return out


def run_bench(cfg: BenchConfig, models=None, command: str | None = None) -> dict[str, Any]:
    """Run every method on the same prompt batches; return the report dict (see report.validate_report)."""
    from tqdm.auto import tqdm

    import hf_ssd  # noqa: F401

    t_start = time.perf_counter()
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    for s in cfg.settings:
        if s not in SETTINGS:
            raise ValueError(f"unknown setting {s!r}; choose from {SETTINGS}")
    target, draft, tok, model_info = models if models is not None else load_models(cfg)
    if cfg.draft_quantize:
        from ..draft_quant import quantized_draft

        draft = quantized_draft(draft, cfg.draft_quantize)
        model_info = {**model_info, "draft_quantize": cfg.draft_quantize}
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    prompts = load_bench_prompts(cfg, tok)
    workers, skipped = available_workers(target, draft, cfg.workers) if "ssd" in cfg.methods else ([], {})
    methods = plan_methods(cfg, workers)
    if "process" in workers:  # one kept draft process for all runs: its start-up is not part of any timing
        from ..process_worker import DraftProcess

        _PROCESS["worker"] = DraftProcess(draft)
    try:
        return _run_units(cfg, command, target, draft, tok, model_info, prompts, workers, skipped, methods, pad_id,
                          eos_ids, t_start, load_at_start)
    finally:
        if "worker" in _PROCESS:
            _PROCESS.pop("worker").close()


def _run_units(cfg, command, target, draft, tok, model_info, prompts, workers, skipped, methods, pad_id, eos_ids,
               t_start, load_at_start) -> dict[str, Any]:
    from tqdm.auto import tqdm

    units = []
    for setting in cfg.settings:
        for temp in cfg.temperatures:
            for b in cfg.batch_sizes:
                batches = [prompts[i:i + b] for i in range(0, len(prompts), b)]
                for m in methods:
                    if m.batch1_only and b > 1:
                        continue
                    units.append((setting, temp, b, m, batches))
    total = sum(len(u[4]) * cfg.repeats + (cfg.warmup if u[4] else 0) for u in units)
    results, samples = [], []
    plain_out: dict[tuple, list[list[int]]] = {}
    bar = tqdm(total=total, desc="bench", unit="gen", disable=not cfg.progress)
    for setting, temp, b, m, batches in units:
        bar.set_postfix_str(f"{setting} T={temp} b={b} {m.name}")
        for w in range(cfg.warmup):  # untimed: first-call allocations, budget measurement, thread pools
            ids, mask = left_pad([p["input_ids"] for p in batches[w % len(batches)]], pad_id)
            generate_once(m, target, draft, ids, mask, cfg=cfg, setting=setting, temperature=temp, pad_id=pad_id,
                          eos_ids=eos_ids, max_new_tokens=min(8, cfg.max_new_tokens))
            bar.update()
        runs = []
        for bi, batch in enumerate(batches):
            ids, mask = left_pad([p["input_ids"] for p in batch], pad_id)
            for rep in range(cfg.repeats):
                r = generate_once(m, target, draft, ids, mask, cfg=cfg, setting=setting, temperature=temp,
                                  pad_id=pad_id, eos_ids=eos_ids)
                bar.update()
                key = (setting, temp, b, bi)
                eq = None
                if temp == 0:
                    if m.kind == "plain" and rep == 0:
                        plain_out[key] = r["tokens"]
                    if key in plain_out:
                        eq = greedy_equal(r["tokens"], plain_out[key])[0]
                cats = sorted({p["category"] for p in batch})
                sets = sorted({p["set"] for p in batch})
                runs.append(r)
                samples.append({
                    "setting": setting, "temperature": temp, "batch_size": b, "method": m.name, "batch_index": bi,
                    "repeat": rep, "prompt_ids": [p["id"] for p in batch],
                    "category": cats[0] if len(cats) == 1 else "mixed", "prompt_set": sets[0] if len(sets) == 1
                    else "mixed", "new_tokens": sum(len(t) for t in r["tokens"]), "wall_s": r["wall_s"],
                    "ttft_s": r["ttft_s"], "tokens_per_s_e2e": safe_div(sum(len(t) for t in r["tokens"]),
                                                                         r["wall_s"]),
                    "tokens_per_s_decode": safe_div(sum(len(t) for t in r["tokens"]) - len(r["tokens"]),
                                                    r["wall_s"] - r["ttft_s"]),
                    "hit_rate": (r["ssd_stats"] or {}).get("hit_rate"),
                    "mean_tokens_per_round": (r["ssd_stats"] or {}).get("mean_tokens_per_round"),
                    "greedy_equal": eq, "threads": r["threads"],
                })
        agg = aggregate_runs(runs, b)
        eqs = [s["greedy_equal"] for s in samples if s["setting"] == setting and s["temperature"] == temp
               and s["batch_size"] == b and s["method"] == m.name]
        agg["greedy_equal"] = None if temp != 0 or any(e is None for e in eqs) else all(eqs)
        agg["greedy_equal_runs"] = None if agg["greedy_equal"] is None else f"{sum(eqs)}/{len(eqs)}"
        results.append({"setting": setting, "temperature": temp, "batch_size": b, "method": m.name,
                        "kind": m.kind, "option": m.option, "threads": runs[-1]["threads"] if runs else None, **agg})
    bar.close()
    add_speedups(results)
    torch.set_num_threads(min(2, os.cpu_count() or 2))
    return {
        "schema_version": None,  # filled by report.finalize
        "command": command or " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": time.perf_counter() - t_start,
        "config": cfg.to_dict(),
        "models": model_info,
        "versions": versions(),
        "machine": {**machine_info(), "load_avg_at_start": load_at_start},
        "workers": {"available": workers, "skipped": skipped},
        "methods": [m.name for m in methods],
        "prompts": [{k: p[k] for k in ("id", "set", "category")} | {"tokens": len(p["input_ids"])} for p in prompts],
        "results": results,
        "samples": samples,
        "notes": NOTES,
    }


NOTES = [
    "tokens_per_s_e2e = new tokens / wall time of generate() (prefill included); tokens_per_s_decode = "
    "(new tokens - 1 per row) / (wall - time to first token). For SD/SSD the first token comes out of the first "
    "verify round, so its drafting is counted in the time to first token.",
    "speedup_vs_* compare decode tokens/s within the same setting, temperature and batch size (_e2e: end-to-end). "
    "hf_best = the fastest transformers assisted-generation schedule of that group (batch 1 only).",
    "fraction_of_round_limit = decode tokens/s / (batch x mean tokens per round / mean verify time).",
    "greedy_equal: per-row tokens identical to plain generate() in the same setting and batch (T=0 only).",
    "paper setting: target on 1 thread in every method; parallel SSD workers add 1 draft thread. equal: every "
    "method may use both cores.",
    "peak_rss_mb: peak resident memory of the whole process while the method ran (both models included).",
]
