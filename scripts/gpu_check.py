"""GPU check for hf_ssd: one prepared run that gets everything a lent GPU can tell us, inside one time budget.

USAGE. On the GPU box, from the repository root (the script puts ./src on sys.path itself; nothing to install,
no download: every model is built from a config with random weights):

    python3 scripts/gpu_check.py --out $OUT/gpu_check.json

i.e. the device tool's run(command="python3 scripts/gpu_check.py --out $OUT/gpu_check.json", timeout_s=480).
The run takes about 4-7 minutes and ends by itself before --budget-s (420 s); output_tail shows the summary and the
JSON comes back as gpu_check.json. Here (no GPU):

    python scripts/gpu_check.py --cpu --out /tmp/gpu_check.json    # dry run: tiny models, no timing targets (~3 min)
    python scripts/gpu_check.py --sections exactness,sync          # a subset (the env block is always recorded)
    python scripts/gpu_check.py --methods plain,sd,ssd_thread_compiled   # a subset of the timed methods

If "env.hf_ssd_import_error" is set, or everything of ours fails on the box's older transformers (the box had 5.17;
hf_ssd pins >= 5.23, and the --cpu dry run passed on both 5.17.0 and 5.24.0), carry a transformers wheel as the
device README says (`pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0`; its other needs are
on the box) and start the command with `python3 -m pip install -q --no-index --no-deps --target /tmp/site
.whl/*.whl && export PYTHONPATH=/tmp/site;`.

The whole run stays inside --budget-s (default 420 s, so a device command with timeout_s=480 has a margin): every
section has a wall-clock cap and is skipped ("skipped": "time") when too little of the budget is left, and a
watchdog writes the JSON and exits (code 3) if the budget runs out mid-section. The JSON (default
benchmarks/gpu/gpu_check.json, or --out) is rewritten after every section and every timed method, so a run that is
killed still leaves everything measured so far. Exit code: 0 = exactness and the sync check passed, 1 = one failed,
2 = no CUDA device (and no --cpu), 3 = the budget ran out.

HOW TO READ THE RESULT (the JSON's keys; the same lines are printed at the end):
- "exactness": greedy output == plain generate() (float32 small models, CUDA) for sync SD and SSD with the inline and
  thread workers, compile off and ssd_compile=True, batch 1 and batch 3 with left padding ("greedy_*": true is a
  pass); "compiled_path_used" says whether the ssd_compile=True runs really ran compiled (draft_compiled, no
  fallback_reason), and "seeded_sampling_*" whether seeded sampling is the same on the thread and inline workers.
- "sync": the static draft's hot path (StaticSaguaroDrafter.begin_no_sync + the speculation-cache lookup) under
  torch.cuda.set_sync_debug_mode("error"), greedy and sampled, eager static cache and compiled: "pass": true means no
  device->host synchronisation happened there (--cpu instead counts Python-level host reads, as the CPU test does).
- "perf": Qwen2.5-1.5B-shaped target (hidden 1536, 28 layers, 12 heads / 2 KV heads, intermediate 8960, vocab 151936)
  in bf16, batch 1, greedy, K=4, random weights (no download). The draft is NOT a 0.5B-shaped model: for α control it
  is the target's first 8 layers at the target's width, the target's layers 8..27 neutralised (o_proj and down_proj
  zero: they cost their full compute but add nothing), so draft and target compute the same logits (α = 1); with
  --alpha-noise the draft is perturbed (α < 1). "perf.construction" spells out what was built. Methods:
  plain (eager generate), plain_static_compile (transformers' static cache + compile_config, as the bench's
  plain:static-compile), assisted (transformers' assisted generation, num_assistant_tokens=K, constant schedule),
  sd (our synchronous SD), ssd_thread (SSD, thread worker, compile off), ssd_thread_compiled (ssd_compile=True after
  hf_ssd.warmup), ssd_inline_compiled (extra: the same in the caller's thread), sd_compiled and
  ssd_thread_compiled_target (SD / SSD with the verify compiled too: ssd_compile + ssd_compile_target; "sd" in
  the ratios is the faster of sd and sd_compiled), ssd_auto (ssd=True, no options: the controller). Each has tok_s (best of --repeats timed runs after a warm-up), identical_to_plain (and, on a
  mismatch, where and the target's top-2 logit gap there: a gap of a bf16 rounding step or two is a near-tie that
  batched bf16 verification can flip; the fp32 "exactness" section is the strict check), hit_rate,
  overlap_fraction, alpha_est (accepted / drafted).
- "perf.ratios": per SSD variant, SSD/assisted (target >= 2), SSD/sd (>= 1.3), SSD/plain and
  SSD/plain_static_compile, overlap (>= 0.90) and greedy identity, each marked PASS/FAIL (n/a with --cpu).
  "targets" (top level, and the HEADLINE lines printed last): exactness and sync pass/fail, and the fastest SSD
  variant of "perf" / "perf_alpha" with its ratios and verdicts. Check "graphs_compiled_in_timed_runs" (0 expected)
  and the compiled methods' stats.draft_compile_s (0 after hf_ssd.warmup) for recompilation.
- "perf_alpha": sd, assisted and SSD again with the draft noised (--alpha-noise-extra, default 0.014: α ≈ 0.7 at the
  CPU overhead workload's width; the measured alpha_est is what counts), if the budget allows.
- Anything that failed records "error" (and a traceback tail) instead of stopping the run; e.g. an older
  transformers without compile_config shows up as an error of plain_static_compile only.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()  # the budget counts from here (imports included)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "src" / "hf_ssd").is_dir() and str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))  # the GPU box runs the working tree as it is, nothing installed

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

try:
    import hf_ssd  # noqa: F401  (enables generate(..., ssd=True))

    HF_SSD_ERROR = None
except Exception as exc:  # noqa: BLE001 - recorded; plain/assisted timings still run
    hf_ssd = None
    HF_SSD_ERROR = f"{type(exc).__name__}: {exc}"

SECTIONS = ("exactness", "sync", "perf", "perf_alpha")
METHODS = ("plain", "assisted", "sd", "ssd_thread", "ssd_auto", "ssd_thread_compiled", "ssd_inline_compiled",
           "sd_compiled", "ssd_thread_compiled_target", "plain_static_compile")  # the order they run in: the costly compiles last
SSD_VARIANTS = ("ssd_thread", "ssd_thread_compiled", "ssd_inline_compiled", "ssd_thread_compiled_target", "ssd_auto")
TARGETS = {"ssd_over_assisted": 2.0, "ssd_over_sd": 1.3, "overlap_fraction": 0.90}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def _tail(exc: BaseException) -> dict:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {str(exc)[:800]}", "traceback_tail": "".join(tb)[-1500:]}


# ---- the run: budget, incremental JSON, watchdog ------------------------------------------------------------------
class Run:
    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s = out, budget_s
        self.results: dict = {"status": "running", "budget_s": budget_s}
        self.current = "setup"
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(1.0, budget_s - self.elapsed()), self._abort)
        self._timer.daemon = True
        self._timer.start()

    def elapsed(self) -> float:
        return time.perf_counter() - T0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def write(self) -> None:
        with self._lock:
            self.results["elapsed_s"] = round(self.elapsed(), 1)
            for _ in range(5):  # the main thread may be mutating the dict while the watchdog writes
                try:
                    text = json.dumps(self.results, indent=2, default=str)
                    break
                except RuntimeError:
                    time.sleep(0.05)
            else:
                return
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_suffix(self.out.suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out)

    def _abort(self) -> None:
        self.results["status"] = f"aborted: time (budget {self.budget_s:.0f} s ran out in section {self.current!r})"
        sec = self.results.get(self.current)
        if isinstance(sec, dict):
            sec["status"] = "aborted: time"
        try:
            self.results["targets"] = headline(self.results)
        except Exception:  # noqa: BLE001 - never let the summary stop the write
            pass
        try:
            self.write()
        finally:
            print(f"\n!!! {self.results['status']}; partial results in {self.out}", flush=True)
            os._exit(3)

    def section(self, name: str, fn, need_s: float, cap_s: float, *args) -> dict:
        """Run fn(sec, *args) unless less than need_s is left; sec is the section's result dict (filled as it goes)
        and sec_left() its remaining time: min(cap, what the budget leaves)."""
        if self.left() < need_s:
            self.results[name] = {"skipped": "time", "left_s": round(self.left(), 1), "needed_s": need_s}
            log(f"== {name}: skipped: time ({self.left():.0f} s left, needs {need_s:.0f} s)")
            self.write()
            return self.results[name]
        sec: dict = {"status": "running"}
        self.results[name] = sec
        self.current = name
        start = time.perf_counter()
        deadline = start + cap_s
        sec_left = lambda: min(deadline - time.perf_counter(), self.left())  # noqa: E731
        log(f"== {name} (cap {cap_s:.0f} s, {self.left():.0f} s left)")
        self.write()
        try:
            fn(sec, sec_left, *args)
            sec["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a broken section must not stop the others
            sec.update(_tail(exc))
            sec["status"] = "error"
            log(f"   {name}: ERROR {sec['error'][:300]}")
        sec["elapsed_s"] = round(time.perf_counter() - start, 1)
        self.current = "between sections"
        self.write()
        return sec

    def done(self, status: str) -> None:
        self._timer.cancel()
        self.results["status"] = status
        self.write()


def sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- models -------------------------------------------------------------------------------------------------------
def qwen2_config(vocab, hidden, inter, layers, heads, kv_heads, init_range, tie):
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, initializer_range=init_range,
                       tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def prefix_pair(shape: dict, draft_layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    """(target, draft): random Qwen2 target whose layers draft_layers.. add nothing (o_proj, down_proj = 0) and its
    first draft_layers layers (same embeddings, final norm and head) as the draft: both compute the same logits."""
    torch.manual_seed(seed)
    tcfg = qwen2_config(**shape)
    dcfg = qwen2_config(**{**shape, "layers": draft_layers})
    with torch.device(device):  # initialised where it runs (a 1.5B fp32 init on the CPU would take long)
        target = Qwen2ForCausalLM(tcfg)
        with torch.no_grad():
            for layer in target.model.layers[draft_layers:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        target = target.to(dtype).eval()
        draft = Qwen2ForCausalLM(dcfg).to(dtype).eval()
    missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    assert not [k for k in missing if "rotary" not in k], missing
    assert all(k.startswith("model.layers.") and int(k.split(".")[2]) >= draft_layers for k in unexpected), unexpected
    for m in (target, draft):
        m.generation_config.pad_token_id = 0
        m.generation_config.eos_token_id = None  # fixed-length decoding: every method makes exactly N tokens
        m.generation_config.bos_token_id = None
    return target, draft


@torch.no_grad()
def add_noise(model, scale: float, seed: int) -> None:
    """In place (same tensors, so compiled graphs and CUDA graphs stay valid): seeded Gaussian noise of `scale` times
    each weight tensor's std, as the overhead workload's alpha_noise does."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        if p.is_floating_point() and p.numel() > 1:
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.device)
            p.add_((noise * scale * (p.float().std() + 1e-6)).to(p.dtype))


_SMALL: dict = {}


def small_pair(device: str):
    """Small float32 pair for the exactness and sync checks: 4-layer target, its first 2 layers (noised: α < 1, so
    rejections, misses and backups all happen) as the draft. One pair per process: the sync check's compiled case
    reuses the graphs the exactness section compiled (same model, batch 3, same cache bucket)."""
    if device not in _SMALL:
        shape = dict(vocab=512, hidden=128, inter=256, layers=4, heads=4, kv_heads=2, init_range=0.2, tie=False)
        target, draft = prefix_pair(shape, 2, device, torch.float32)
        add_noise(draft, 0.02, seed=1)
        _SMALL[device] = (target, draft)
    return _SMALL[device]


def left_padded(B: int, L: int, vocab: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, L), generator=g)
    mask = torch.ones_like(ids)
    for b in range(B):
        pad = (3 + 4 * b) % (L - 1)
        ids[b, :pad] = 0
        mask[b, :pad] = 0
    return ids.to(device), mask.to(device)


# ---- 1. exactness -------------------------------------------------------------------------------------------------
def exactness(sec: dict, sec_left, device: str, new_tokens: int) -> None:
    target, draft = small_pair(device)
    K, BUDGET = 3, 4  # glue K+1 == tree width N: one compiled graph per batch size
    fixed = dict(assistant_model=draft, ssd=True, ssd_num_draft_tokens=K, ssd_draft_quantize=None,
                 return_dict_in_generate=True, do_sample=False)
    checks, compiled_info = {}, {}
    sec["checks"], sec["compiled_runs"] = checks, compiled_info
    for compile_ in (False, True):
        for B in (1, 3):
            ids, mask = left_padded(B, 12, 512, device, seed=B)
            ref = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
            combos = [("sync", "inline"), ("ssd", "inline"), ("ssd", "thread")]
            for mode, worker in combos:
                name = f"greedy_{mode}_{worker}_b{B}" + ("_compiled" if compile_ else "")
                if sec_left() < 10:
                    checks[name] = "skipped: time"
                    continue
                kw = dict(fixed, ssd_mode=mode, attention_mask=mask, max_new_tokens=new_tokens)
                kw["ssd_compile"] = compile_  # sync: its draft steps on the static cache
                if mode == "ssd":
                    kw.update(ssd_worker=worker, ssd_budget=BUDGET, ssd_backup="jit")
                t0 = time.perf_counter()
                try:
                    out = target.generate(ids, **kw)
                    checks[name] = bool(torch.equal(out.sequences, ref))
                    st = out.ssd_stats or {}
                    if compile_:
                        compiled_info[name] = {k: st.get(k) for k in ("draft_static", "draft_compiled",
                                                                        "draft_compile_s", "fallback_reason")}
                except Exception as exc:  # noqa: BLE001
                    checks[name] = False
                    sec.setdefault("errors", {})[name] = _tail(exc)
                log(f"   {name}: {checks[name]} ({time.perf_counter() - t0:.1f} s)")
    # seeded sampling: the thread worker draws exactly what the inline worker draws (compile off, and compiled)
    ids, mask = left_padded(3, 12, 512, device, seed=3)
    for compile_ in (False, True):
        name = "seeded_sampling_thread_equals_inline" + ("_compiled" if compile_ else "")
        if sec_left() < 10:
            checks[name] = "skipped: time"
            continue
        kw = dict(fixed, attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=0,
                  ssd_mode="ssd", ssd_budget=BUDGET, ssd_downweight=0.5, ssd_compile=compile_, ssd_backup="jit")
        try:
            a = target.generate(ids, generator=torch.Generator(device).manual_seed(3), ssd_worker="inline", **kw)
            b = target.generate(ids, generator=torch.Generator(device).manual_seed(3), ssd_worker="thread", **kw)
            checks[name] = bool(torch.equal(a.sequences, b.sequences))
        except Exception as exc:  # noqa: BLE001
            checks[name] = False
            sec.setdefault("errors", {})[name] = _tail(exc)
        log(f"   {name}: {checks[name]}")
    ran = [v for v in checks.values() if isinstance(v, bool)]
    sec["pass"] = bool(ran) and all(ran)
    sec["compiled_path_used"] = bool(compiled_info) and all(
        v.get("draft_compiled") and v.get("fallback_reason") is None for v in compiled_info.values())


# ---- 3. hot-path sync check ---------------------------------------------------------------------------------------
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@contextmanager
def no_sync_allowed(device: str, calls: list):
    """CUDA: torch.cuda.set_sync_debug_mode("error") (any device->host sync raises). CPU (dry run): count
    Python-level host reads of tensors, as tests/draft/test_static_draft.py does."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    saved_nonzero = torch.nonzero

    def wrap(name, original):
        def patched(self, *a, **k):
            calls.append(name)
            return original(self, *a, **k)
        return patched

    for name, original in saved.items():
        setattr(torch.Tensor, name, wrap(name, original))
    torch.nonzero = wrap("torch.nonzero", saved_nonzero)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = saved_nonzero


def sync_case(device: str, draft, greedy: bool, compiled: bool, rounds: int, warm: int) -> dict:
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from hf_ssd.config import SSDConfig
    from hf_ssd.core.types import Outcome, Verdict
    from hf_ssd.draft.model import DraftModel
    from hf_ssd.core.tree import tree_width
    from hf_ssd.draft.static_saguaro import StaticSaguaroDrafter
    from hf_ssd.runtime.static_kv import StaticCachedModel, static_cache_len
    from hf_ssd.runtime.stats import SSDStats

    K, BUDGET, B, vocab = 3, 4, 3, draft.config.vocab_size
    config = SSDConfig(mode="ssd", num_draft_tokens=K, budget=BUDGET, downweight=0.5, backup="jit",
                       worker="inline", draft_quantize=None)
    N = tree_width(config, K, BUDGET, vocab)
    kv = StaticCachedModel(draft, B, static_cache_len(64, K, N), compile=compiled, hot_widths=(K + 1, N))
    warpers = LogitsProcessorList([] if greedy else [TemperatureLogitsWarper(0.8), TopKLogitsWarper(20),
                                                     TopPLogitsWarper(0.9)])
    gen = None if greedy else torch.Generator(device).manual_seed(3)
    dm = DraftModel(draft, B, vocab, warpers, greedy, 0.5, gen, kv)
    sta = StaticSaguaroDrafter(dm, config, SSDStats(), BUDGET, greedy)
    ids, mask = left_padded(B, 10, vocab, device, seed=5)
    res = {"rounds_checked": 0, "host_reads": []}
    try:
        spec = sta.start(ids, mask)
        rows = B
        for rnd in range(rounds):
            k = torch.zeros(rows, dtype=torch.long, device=device)
            checked = rnd >= warm  # compiled: the first rounds record the CUDA graphs (which may synchronise)
            calls: list = []
            if checked:
                with no_sync_allowed(device, calls):
                    sta.begin_no_sync(spec)
                    outcome = Outcome(k, sta.cache.forks.tokens[:, 0])
                    sta.cache.lookup(outcome)
                res["rounds_checked"] += 1
                res["host_reads"] += calls
            else:
                sta.begin_no_sync(spec)
                outcome = Outcome(k, sta.cache.forks.tokens[:, 0])
                sta.cache.lookup(outcome)
            keep = torch.ones(rows, dtype=torch.bool, device=device)
            if rnd == 1:
                keep[0] = False  # a row finishes: a dead row of the static batch from then on
            n_keep = int(keep.sum())
            ctx = [torch.arange(5, device=device)] * n_keep
            verdict = Verdict(outcome, keep, ctx, [torch.ones(5, device=device)] * n_keep, 0.0)
            spec = sta.resolve(verdict).spec
            rows = n_keep
        res["compiled_calls"] = kv.compiled_calls
        res["pass"] = not res["host_reads"] and res["rounds_checked"] > 0
    except Exception as exc:  # noqa: BLE001 - a sync under "error" mode raises here
        res.update(_tail(exc))
        res["pass"] = False
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        sta.close()
    return res


def sync_check(sec: dict, sec_left, device: str) -> None:
    if hf_ssd is None:
        raise RuntimeError(f"hf_ssd did not import: {HF_SSD_ERROR}")
    _, draft = small_pair(device)
    sec["mode"] = ('torch.cuda.set_sync_debug_mode("error")' if device == "cuda" else
                   "Python-level host-read counter (CPU dry run; set_sync_debug_mode is CUDA-only)")
    cases = {}
    sec["cases"] = cases
    for compiled in (False, True):
        for greedy in (True, False):
            name = f"{'greedy' if greedy else 'sampled'}_{'compiled' if compiled else 'eager'}"
            if sec_left() < (40 if compiled else 5):
                cases[name] = {"skipped": "time"}
                continue
            t0 = time.perf_counter()
            cases[name] = sync_case(device, draft, greedy, compiled, rounds=7 if compiled else 4,
                                    warm=4 if compiled else 0)
            log(f"   {name}: pass={cases[name]['pass']} ({time.perf_counter() - t0:.1f} s)"
                + (f" {cases[name].get('error', '')[:200]}" if not cases[name]["pass"] else ""))
    ran = [c["pass"] for c in cases.values() if "pass" in c]
    sec["pass"] = bool(ran) and all(ran)


# ---- 2. performance at real shapes ---------------------------------------------------------------------------------
def static_compile_config(model):
    """As hf_ssd.tools.bench.runner.static_compile_config (plain:static-compile): generate() with the static cache
    compiles its decode step; reduce-overhead (CUDA graphs) on CUDA, inductor's default elsewhere."""
    from transformers import CompileConfig

    cuda = model.device.type == "cuda"
    cc = CompileConfig(fullgraph=False, dynamic=True, mode="reduce-overhead" if cuda else "default")
    if not cuda:
        cc._compile_all_devices = True
    return cc


def compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return 0


class Perf:
    """The models, the prompt and the plain reference, shared by "perf" and "perf_alpha"."""

    def __init__(self, args, device: str):
        self.device, self.args = device, args
        self.K, self.budget = args.K, args.budget
        if args.cpu:
            self.shape = dict(vocab=512, hidden=64, inter=128, layers=6, heads=4, kv_heads=2, init_range=0.2,
                              tie=True)
            self.draft_layers, self.dtype = 2, torch.float32
            self.prompt_len, self.new_tokens = 16, args.new_tokens or 24
        else:
            self.shape = dict(vocab=151936, hidden=1536, inter=8960, layers=28, heads=12, kv_heads=2, init_range=0.2,
                              tie=True)
            self.draft_layers = 8
            self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
            self.prompt_len, self.new_tokens = args.prompt_len, args.new_tokens or 128
        self.target = self.draft = None
        self.ref = None  # plain eager output: the greedy reference
        self.noise = 0.0
        self.baselines: dict = {}  # plain / plain_static_compile results (the target never changes)

    def construction(self) -> dict:
        s, d = self.shape, self.draft_layers
        return {
            "target": f"random Qwen2, Qwen2.5-1.5B shapes: hidden {s['hidden']}, {s['layers']} layers, "
                      f"{s['heads']} heads / {s['kv_heads']} KV heads, intermediate {s['inter']}, vocab {s['vocab']}, "
                      f"tied embeddings, init std {s['init_range']}" if not self.args.cpu else
                      f"tiny random Qwen2 (--cpu): {s}",
            "draft": f"the target's first {d} layers at the target's width (same embeddings, final norm, head); "
                     f"NOT the 0.5B shapes (hidden 896, 24 layers): α control needs the draft to be the target's prefix",
            "alpha": f"target layers {d}..{s['layers'] - 1} neutralised (o_proj, down_proj = 0; full compute, no "
                     f"effect), so α = 1 with alpha_noise 0; alpha_noise > 0 adds seeded noise (x each tensor's std) "
                     f"to every draft weight in place",
            "dtype": str(self.dtype).replace("torch.", ""), "batch": 1, "greedy": True, "K": self.K,
            "ssd_budget": self.budget, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens,
            "repeats": self.args.repeats, "eos": None,
        }

    def build(self) -> None:
        self.target, self.draft = prefix_pair(self.shape, self.draft_layers, self.device, self.dtype)
        if self.args.alpha_noise > 0:
            self.set_noise(self.args.alpha_noise)
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(3, self.shape["vocab"], (1, self.prompt_len), generator=g).to(self.device)
        self.mask = torch.ones_like(self.ids)

    def set_noise(self, noise: float) -> None:
        if noise != self.noise:
            if noise < self.noise:
                raise ValueError("noise only grows in place")
            add_noise(self.draft, (noise ** 2 - self.noise ** 2) ** 0.5, seed=int(noise * 1e6) + 1)
            self.noise = noise

    # ---- one method ------------------------------------------------------------------------------------------------
    def kwargs(self, method: str) -> dict:
        K, budget, d = self.K, self.budget, self.draft
        fixed_ssd = dict(assistant_model=d, ssd=True, ssd_mode="ssd", ssd_num_draft_tokens=K, ssd_budget=budget,
                         ssd_draft_quantize=None)
        return {
            "plain": {},
            "plain_static_compile": dict(cache_implementation="static"),  # + compile_config, set in run()
            "assisted": dict(assistant_model=d),
            "sd": dict(assistant_model=d, ssd=True, ssd_mode="sync", ssd_num_draft_tokens=K, ssd_draft_quantize=None),
            "ssd_thread": dict(fixed_ssd, ssd_worker="thread", ssd_compile=False),
            "ssd_thread_compiled": dict(fixed_ssd, ssd_worker="thread", ssd_compile=True),
            "ssd_inline_compiled": dict(fixed_ssd, ssd_worker="inline", ssd_compile=True),
            # everything compiled: the verify block too (ssd_compile_target), for SD and SSD alike
            "sd_compiled": dict(assistant_model=d, ssd=True, ssd_mode="sync", ssd_num_draft_tokens=K,
                                ssd_draft_quantize=None, ssd_compile=True, ssd_compile_target=True),
            "ssd_thread_compiled_target": dict(fixed_ssd, ssd_worker="thread", ssd_compile=True,
                                               ssd_compile_target=True),
            "ssd_auto": dict(assistant_model=d, ssd=True),
        }[method]

    def generate(self, kw: dict):
        """One generation as a user calls it (generate() runs under no_grad itself; no inference_mode, which would
        give the compiled draft graphs another global state than hf_ssd.warmup's)."""
        sync_device(self.device)
        t0 = time.perf_counter()
        out = self.target.generate(self.ids, attention_mask=self.mask, max_new_tokens=self.new_tokens,
                                   do_sample=False, temperature=None, top_k=None, top_p=None,
                                   return_dict_in_generate=True, **kw)
        sync_device(self.device)
        return out, time.perf_counter() - t0

    def warmup_compiled_draft(self) -> dict:
        from hf_ssd.config import SSDConfig

        cfg = SSDConfig(mode="ssd", worker="thread", num_draft_tokens=self.K, budget=self.budget,
                        draft_quantize=None, compile=True)
        return hf_ssd.warmup(self.target, self.draft, batch_size=1, max_new_tokens=self.new_tokens,
                             prompt_len=self.prompt_len, K=self.K, budget=self.budget, config=cfg, progress=False)

    def run(self, method: str, res: dict) -> None:
        """Warm up (untimed, full length), then --repeats timed runs; fills res as it goes."""
        kw = self.kwargs(method)
        saved = None
        if method == "plain_static_compile":
            kw["compile_config"] = static_compile_config(self.target)  # raises on a transformers without it
        if method == "assisted":
            gc = self.draft.generation_config
            keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
            saved = {k: getattr(gc, k, None) for k in keys}
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = self.K, "constant"
            gc.assistant_confidence_threshold = 0.0
        if method in ("ssd_thread_compiled", "ssd_inline_compiled") and "warmup" not in res:
            t0 = time.perf_counter()
            res["warmup"] = self.warmup_compiled_draft()
            log(f"   {method}: hf_ssd.warmup {time.perf_counter() - t0:.1f} s: {res['warmup']}")
        try:
            graphs = compiled_graphs()
            _, warm_s = self.generate(kw)
            res["warmup_run_s"] = round(warm_s, 3)
            if method == "plain_static_compile" and compiled_graphs() != graphs:
                _, s2 = self.generate(kw)  # the first call compiled: one more untimed call (CUDA graph recording)
                res["warmup_run2_s"] = round(s2, 3)
            runs = []
            graphs = compiled_graphs()
            for _ in range(self.args.repeats):
                out, secs = self.generate(kw)
                runs.append((out.sequences.shape[1] - self.ids.shape[1]) / secs)
            res["graphs_compiled_in_timed_runs"] = compiled_graphs() - graphs  # > 0: a recompilation per call
            res["tok_s_runs"] = [round(r, 2) for r in runs]
            res["tok_s"] = round(max(runs), 2)
        finally:
            if saved is not None:
                for k, v in saved.items():
                    setattr(self.draft.generation_config, k, v)
        seq = out.sequences
        if method == "plain" and self.ref is None:
            self.ref = seq
            toks = seq[0, self.prompt_len:].tolist()
            res["distinct_tokens"] = len(set(toks))
        res.update(self.compare(seq))
        if method.startswith("plain"):
            self.baselines[method] = res
        st = getattr(out, "ssd_stats", None)
        if st:
            drafted = st.get("drafted") or 0
            res["stats"] = {k: st.get(k) for k in (
                "mode", "worker", "rounds", "hit_rate", "overlap_fraction", "mean_accepted", "mean_tokens_per_round",
                "draft_static", "draft_compiled", "draft_compile_s", "fallback_reason", "budget", "backup_rounds",
                "phase_means_s", "controller")}
            res["alpha_est"] = round(st.get("accepted", 0) / drafted, 4) if drafted else None
            res["hit_rate"] = st.get("hit_rate")
            ov = st.get("overlap_fraction")
            res["overlap_fraction"] = None if ov is None else round(ov, 4)

    def compare(self, seq) -> dict:
        if self.ref is None:
            return {"identical_to_plain": None}
        if seq.shape == self.ref.shape and torch.equal(seq, self.ref):
            return {"identical_to_plain": True}
        n = min(seq.shape[1], self.ref.shape[1])
        diff = (seq[0, :n] != self.ref[0, :n]).nonzero()
        at = int(diff[0]) if len(diff) else n
        info = {"identical_to_plain": False, "first_mismatch_new_token": at - self.prompt_len}
        try:  # the target's own top-2 logit gap where they part: a near-tie in bf16 is rounding, not a bug
            with torch.no_grad():
                logits = self.target(self.ref[:, :at]).logits[0, -1].float()
            top = logits.topk(2).values
            info["top2_logit_gap_there"] = round(float(top[0] - top[1]), 5)
            info["top_logit_there"] = round(float(top[0]), 3)
            info["bf16_step_at_top"] = round(float(torch.finfo(torch.bfloat16).eps * abs(top[0])), 5)
        except Exception as exc:  # noqa: BLE001
            info["gap_error"] = str(exc)[:200]
        return info


def perf_section(sec: dict, sec_left, run: Run, perf: Perf, methods: list[str], tag: str) -> None:
    sec["construction"] = perf.construction()
    if perf.target is None:
        t0 = time.perf_counter()
        perf.build()
        sec["build_s"] = round(time.perf_counter() - t0, 1)
        log(f"   built the pair in {sec['build_s']} s ({perf.construction()['dtype']}, {perf.device})")
    sec["alpha_noise"] = perf.noise
    res_all: dict = {}
    sec["methods"] = res_all
    cpu = perf.args.cpu
    need = {"plain": 15, "assisted": 15, "sd": 15, "ssd_thread": 15, "ssd_auto": 30, "ssd_thread_compiled": 90,
            "ssd_inline_compiled": 15, "sd_compiled": 90, "ssd_thread_compiled_target": 90,
            "plain_static_compile": 150}
    for m in methods:
        n = need[m] if not cpu else need[m] / 3
        if sec_left() < n:
            res_all[m] = {"skipped": "time", "left_s": round(sec_left(), 1), "needed_s": n}
            log(f"   {tag}/{m}: skipped: time")
            run.write()
            continue
        if hf_ssd is None and m not in ("plain", "assisted", "plain_static_compile"):
            res_all[m] = {"error": f"hf_ssd did not import: {HF_SSD_ERROR}"}
            continue
        res: dict = {"status": "running"}
        res_all[m] = res
        run.write()
        t0 = time.perf_counter()
        try:
            perf.run(m, res)
            res["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - e.g. compile_config on an older transformers
            res.update(_tail(exc))
            res["status"] = "error"
        res["section_s"] = round(time.perf_counter() - t0, 1)
        msg = res.get("error", "")[:200] if res["status"] == "error" else (
            f"{res.get('tok_s')} tok/s, identical={res.get('identical_to_plain')}, hit={res.get('hit_rate')}, "
            f"overlap={res.get('overlap_fraction')}, alpha_est={res.get('alpha_est')}")
        log(f"   {tag}/{m} ({res['section_s']} s): {msg}")
        run.write()
    sec["ratios"] = ratios({**perf.baselines, **res_all}, cpu)


def ratios(res: dict, cpu: bool) -> dict:
    """Per SSD variant: its tok/s over each baseline, and the issue's targets marked PASS / FAIL."""
    def tok(m):
        r = res.get(m) or {}
        return r.get("tok_s")

    out = {}
    for v in SSD_VARIANTS:
        s = tok(v)
        if s is None:
            continue
        r = {"tok_s": s}
        for base in ("assisted", "sd", "plain", "plain_static_compile"):
            ref = max((tok(b) or 0.0) for b in ("sd", "sd_compiled")) if base == "sd" else tok(base)
            if ref:  # "sd": our SD at its best compile setting
                r[f"over_{base}"] = round(s / ref, 3)
        ov = res[v].get("overlap_fraction")
        ident = res[v].get("identical_to_plain")
        checks = {
            "ssd_over_assisted>=2": r.get("over_assisted"), "ssd_over_sd>=1.3": r.get("over_sd"),
            "overlap>=0.90": ov, "greedy_identical": ident,
        }
        limits = {"ssd_over_assisted>=2": TARGETS["ssd_over_assisted"], "ssd_over_sd>=1.3": TARGETS["ssd_over_sd"],
                  "overlap>=0.90": TARGETS["overlap_fraction"]}
        verdict = {}
        for name, value in checks.items():
            if value is None:
                verdict[name] = "n/a"
            elif cpu and name != "greedy_identical":
                verdict[name] = "n/a (cpu dry run)"
            elif name == "greedy_identical":
                verdict[name] = "PASS" if value else "FAIL"
            else:
                verdict[name] = "PASS" if value >= limits[name] else "FAIL"
        r["overlap_fraction"], r["identical_to_plain"], r["targets"] = ov, ident, verdict
        out[v] = r
    return out


# ---- env ----------------------------------------------------------------------------------------------------------
def env_info(device: str, args) -> dict:
    import transformers

    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "hf_ssd": getattr(hf_ssd, "__version__", None),
            "hf_ssd_import_error": HF_SSD_ERROR, "args": vars(args)}
    if device == "cuda":
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        info["cuda"] = torch.version.cuda
    try:
        from transformers import CompileConfig  # noqa: F401

        info["has_compile_config"] = True
    except Exception:  # noqa: BLE001
        info["has_compile_config"] = False
    return info


def headline(results: dict) -> dict:
    """The issue's targets next to the numbers: the fastest SSD variant of "perf" (and of "perf_alpha")."""
    out = {"exactness_pass": results.get("exactness", {}).get("pass"),
           "exactness_compiled_path_used": results.get("exactness", {}).get("compiled_path_used"),
           "sync_check_pass": results.get("sync", {}).get("pass"),
           "targets_wanted": "SSD >= 2x transformers' assisted, >= 1.3x our SD, overlap >= 90%, greedy identical"}
    for tag in ("perf", "perf_alpha"):
        r = (results.get(tag) or {}).get("ratios") or {}
        if r:
            best = max(r, key=lambda v: r[v]["tok_s"])
            out[tag] = {"best_ssd_variant": best, "alpha_noise": results[tag].get("alpha_noise"), **r[best]}
    return out


def print_summary(results: dict) -> None:
    print("\n================ gpu_check summary ================", flush=True)

    def state(sec: dict) -> str:
        if not sec:
            return "not run"
        if "skipped" in sec:
            return f"skipped: {sec['skipped']}"
        return f"pass={sec.get('pass')}" + (f" ERROR {sec['error'][:200]}" if sec.get("error") else "")

    ex = results.get("exactness") or {}
    print(f"exactness: {state(ex)}" + (f" compiled_path_used={ex.get('compiled_path_used')}" if "pass" in ex else ""))
    for k, v in (ex.get("checks") or {}).items():
        print(f"   {k}: {v}")
    sy = results.get("sync") or {}
    print(f"sync check ({sy.get('mode', '-')}): {state(sy)}")
    for k, v in (sy.get("cases") or {}).items():
        print(f"   {k}: pass={v.get('pass')} {v.get('skipped', '')}{v.get('error', '')[:160]}")
    for tag in ("perf", "perf_alpha"):
        p = results.get(tag)
        if not p:
            continue
        print(f"{tag}: alpha_noise={p.get('alpha_noise')} {p.get('skipped', '')}{p.get('error', '')[:300]}")
        for m, r in (p.get("methods") or {}).items():
            if "tok_s" in r:
                print(f"   {m:22s} {r['tok_s']:9.2f} tok/s  identical={r.get('identical_to_plain')}"
                      f"  hit={r.get('hit_rate')}  overlap={r.get('overlap_fraction')}  alpha_est={r.get('alpha_est')}")
            else:
                print(f"   {m:22s} {r.get('skipped') or r.get('error', r.get('status'))}"[:220])
        for v, r in (p.get("ratios") or {}).items():
            print(f"   {v}: " + ", ".join(f"{k}={r[k]}" for k in r if k.startswith("over_")))
            print(f"      targets: {r['targets']}")
    h = results.get("targets") or {}
    for tag in ("perf", "perf_alpha"):
        if tag in h:
            b = h[tag]
            print(f"HEADLINE {tag} (alpha_noise {b['alpha_noise']}): {b['best_ssd_variant']} {b['tok_s']} tok/s; "
                  + ", ".join(f"{k}={b[k]}" for k in b if k.startswith("over_"))
                  + f", overlap={b['overlap_fraction']}, identical={b['identical_to_plain']}; {b['targets']}")
    print(f"status: {results.get('status')}  ({results.get('elapsed_s')} s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with tiny models (no timing targets)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu" / "gpu_check.json"))
    ap.add_argument("--budget-s", type=float, default=None, help="total wall clock (default 420 CUDA, 1500 --cpu)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {METHODS}")
    ap.add_argument("--new-tokens", type=int, default=None, help="per timed run (default 128; 24 with --cpu)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--budget", type=int, default=5, help="ssd_budget (tree width N; 5 = K+1: one compiled graph)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--alpha-noise", type=float, default=0.0, help="draft noise of the main perf section (0: α = 1)")
    ap.add_argument("--alpha-noise-extra", type=float, default=0.014,
                    help="draft noise of the perf_alpha section (0.014: α ≈ 0.7 at the overhead workload's width)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing run (use --cpu for a dry run on the CPU)", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    budget = args.budget_s if args.budget_s is not None else (1500.0 if args.cpu else 420.0)
    sections = [s for s in args.sections.split(",") if s]
    methods = [m for m in METHODS if m in args.methods.split(",")]
    bad = [s for s in sections if s not in SECTIONS] + [m for m in args.methods.split(",") if m not in METHODS]
    if bad:
        ap.error(f"unknown sections/methods: {bad}")
    run = Run(Path(args.out), budget)
    run.results["env"] = env_info(device, args)
    log(f"gpu_check on {run.results['env']['device']}: torch {torch.__version__}, transformers "
        f"{run.results['env']['transformers']}, hf_ssd import error: {HF_SSD_ERROR}; budget {budget:.0f} s; "
        f"writing {args.out}")
    run.write()
    if args.cpu:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if "exactness" in sections:
        if hf_ssd is None:
            run.results["exactness"] = {"error": f"hf_ssd did not import: {HF_SSD_ERROR}", "pass": False}
        else:
            run.section("exactness", exactness, 40, 200, device, 24 if args.cpu else 32)
    if "sync" in sections:
        run.section("sync", sync_check, 15, 100, device)
    perf = Perf(args, device)
    if "perf" in sections:
        run.section("perf", perf_section, 60, 600, run, perf, methods, "perf")
    if "perf_alpha" in sections and args.alpha_noise_extra > args.alpha_noise:
        alpha_methods = [m for m in ("sd", "assisted", "ssd_thread_compiled", "ssd_thread") if m in methods]

        def alpha(sec, sec_left):
            if perf.target is None:  # "perf" was not run: build with the extra noise
                perf.args.alpha_noise = args.alpha_noise_extra
            else:
                perf.set_noise(args.alpha_noise_extra)
            perf_section(sec, sec_left, run, perf, alpha_methods, "perf_alpha")

        run.section("perf_alpha", alpha, 40 if not args.cpu else 20, 300)
    ok = run.results.get("exactness", {}).get("pass") is not False and run.results.get("sync", {}).get(
        "pass") is not False
    run.results["targets"] = headline(run.results)
    run.done("done" if ok else "done: a check failed")
    print_summary(run.results)
    print(f"\nJSON: {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
