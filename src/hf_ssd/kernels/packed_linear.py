"""A faster float32 linear layer for the few rows our engine's forwards carry, on AVX-512 and AVX2 CPUs.

A verify block, a draft tree step or one decode step multiplies a handful of rows by every weight matrix. torch's
GEMM (MKL) packs the weights anew on each such call: measured on the project's 2-core CPU (one thread, a
1536 x 8960 float32 weight), 1 row 3.9 ms, 3 rows 11.3 ms, 9 rows 9.7 ms, while reading the weights once takes
about 2 ms. Here each large weight is packed once per process into blocks of 32 output columns
(`packed_linear.cpp`) and every call streams it once for up to 12 rows (AVX2: 6): 2.0-2.6 ms for 1 to 9 rows. On the default
pair's target (Qwen2.5-Coder-1.5B, float32, one thread) a 3-token forward cost 3.0x a 1-token one before.

It applies inside `PackedLinearMode`, which the engine's dynamic-cache forwards enter (runtime/kv.py): only
`torch.nn.functional.linear` calls on a weight packed here, with float32 input of at most MAX_ROWS rows (or more,
where a measurement at packing says the kernel is still faster there), take it;
everything else runs as before. The packed copy costs the weights' memory once more (float32 target of 1.5B
parameters: ~6 GB), so "auto" packs only where the machine has that memory free.

Same products, summed in another order: outputs differ from torch's by float32 rounding (a few units in the last
place), as torch's own GEMM and GEMV differ from each other. The tests compare it with `packed_linear_reference`
and run the exactness suites with it on.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

BLOCK = 32  # output columns per packed block (packed_linear.cpp)
MAX_ROWS = 48  # rows of input up to which the packed kernel always runs (1.6-7x torch's GEMM here, 1 or 2 threads)
# ... and from which: the AVX2 variant (run on the project's AVX-512 CPU, 1536 x 8960 weight, one thread) made
# 1 row in 5.1 ms against torch's 4.8, 3 rows 4.3 against 14.7, 5 rows 5.1 against 8.9, 9 rows 9.8 against 11.1
MIN_ROWS = {"avx512": 1, "avx2": 2}
# Past MAX_ROWS (a batch's verify block, a prefill) torch's GEMM may catch up, depending on the CPU and its BLAS: each
# model measures these row counts once, at packing, on its most common weight shape, and keeps the kernel up to
# the last one where it was faster (the project's AMD CPU with MKL: faster at all of them, 1.2x at 1536 rows)
CALIBRATION_ROWS = (96, 192, 384, 768, 1536)
MIN_ELEMENTS = 1 << 18  # weights smaller than this (1 MB) stay in cache anyway: torch's GEMM is as fast there
MEMORY_MARGIN_BYTES = 1 << 30  # "auto" packs only if this much memory stays free after the packed copies

_SOURCE = Path(__file__).with_name("packed_linear.cpp")
_LOCK = threading.Lock()
_STATE: dict = {}  # "module" once built, or "error" (the reason it cannot be used here)


class PackedLinearUnavailable(RuntimeError):
    """The packed kernel cannot run on this machine (neither AVX-512 nor AVX2, no compiler, ...)."""


def cpu_isa() -> str | None:
    """"avx512" or "avx2": the widest kernel this CPU runs (as torch's own dispatch sees it), else None."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return "avx512"
    return "avx2" if capability == "AVX2" else None


ISA = cpu_isa()  # the kernel variant calls use (tests set "avx2" to run that path on an AVX-512 machine)


def extension():
    """The compiled kernel, built once per machine (torch caches the build; ~30 s the first time) and loaded once
    per process. Raises PackedLinearUnavailable with the reason when it cannot be."""
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        if "error" in _STATE:
            raise PackedLinearUnavailable(_STATE["error"])
        try:
            if ISA is None:
                raise PackedLinearUnavailable(
                    f"this CPU runs torch at {torch.backends.cpu.get_cpu_capability()}, the kernel needs AVX2")
            from torch.utils.cpp_extension import load

            _ninja_on_path()
            logger.info("loading hf_ssd's packed linear kernel (built once per machine, ~30 s the first time)")
            start = time.perf_counter()
            # each kernel variant carries its own target attribute: the module loads on any x86-64 CPU
            # -fopenmp: at::parallel_for is inline OpenMP; built without it, a call ran on one thread whatever
            # torch's thread count (2 threads, 512 rows of 8960 x 1536: 134 ms against torch's 94)
            module = load(name="hf_ssd_packed_linear", sources=[str(_SOURCE)], extra_cflags=["-O3", *_openmp_flags()],
                          extra_ldflags=_openmp_flags(), verbose=False)
            logger.info("packed linear kernel ready in %.1f s", time.perf_counter() - start)
        except PackedLinearUnavailable as e:
            _STATE["error"] = str(e)
            raise
        except Exception as e:  # no compiler, no ninja, headers missing: torch's GEMM it is
            _STATE["error"] = f"building the kernel failed: {type(e).__name__}: {str(e).strip()[:300]}"
            raise PackedLinearUnavailable(_STATE["error"]) from e
        _STATE["module"] = module
        return module


def _openmp_flags() -> list[str]:
    """The compiler flag that makes at::parallel_for split a call over torch's threads, where torch itself runs on
    OpenMP (its default CPU build); other backends need none."""
    return ["-fopenmp"] if "OpenMP" in torch.__config__.parallel_info().split("ATen parallel backend:")[-1] else []


def _ninja_on_path() -> None:
    """torch builds with the `ninja` it finds on PATH: the PyPI package's (a dependency) where there is no other,
    e.g. when a venv's python runs without the venv activated."""
    import os
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def unavailable_reason() -> str | None:
    """None if the kernel runs here, else why not."""
    try:
        extension()
    except PackedLinearUnavailable as e:
        return str(e)
    return None


# ---- the operation and its reference ---------------------------------------------------------------------------
def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N/32), K, 32]: block b holds output columns 32b..32b+31, k-major."""
    return extension().pack(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    y = extension().packed_linear(x, packed, out_features, ISA == "avx512")
    return y if bias is None else y.add_(bias)


def pack_reference(weight: torch.Tensor) -> torch.Tensor:
    """The packed layout in plain torch (what the kernel's `pack` must produce)."""
    N, K = weight.shape
    blocks = -(-N // BLOCK)
    padded = weight.new_zeros(blocks * BLOCK, K)
    padded[:N] = weight
    return padded.view(blocks, BLOCK, K).transpose(1, 2).contiguous()


def packed_linear_reference(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T from the packed layout, in plain torch."""
    weight = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]
    return F.linear(x, weight, bias)


# ---- a model's packed weights ------------------------------------------------------------------------------------
class PackedWeights:
    """Packed copies of a model's large float32 Linear weights, by weight identity. A weight edited in place after
    packing (its version moved) or replaced is simply not served: its layer runs torch's own GEMM."""

    def __init__(self, model: torch.nn.Module, min_elements: int | None = None):
        start = time.perf_counter()
        self.by_id: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        with torch.no_grad():
            for weight in packable_weights(model, min_elements):
                if id(weight) not in self.by_id:  # tied weights (embedding = lm_head) packed once
                    self.by_id[id(weight)] = (weight, weight._version, pack(weight))
        self.bytes = sum(p.numel() * p.element_size() for _, _, p in self.by_id.values())
        self.max_rows = rows_where_packed_wins(*self._commonest_shape()) if self.by_id else MAX_ROWS
        self.pack_s = time.perf_counter() - start  # once per model and process, the measurement included

    def _commonest_shape(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight (and its packed copy) of the shape that holds the most packed elements: the one whose
        calls decide what a forward costs."""
        total: dict[tuple, int] = {}
        for weight, _, _ in self.by_id.values():
            total[tuple(weight.shape)] = total.get(tuple(weight.shape), 0) + weight.numel()
        shape = max(total, key=total.get)
        weight, _, packed = next(e for e in self.by_id.values() if tuple(e[0].shape) == shape)
        return weight, packed

    @property
    def summary(self) -> str:
        return (f"on: {len(self.by_id)} weights, {self.bytes / 2**30:.2f} GiB packed in {self.pack_s:.1f} s, "
                f"up to {self.max_rows} rows")

    def lookup(self, weight: torch.Tensor) -> torch.Tensor | None:
        entry = self.by_id.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            return None
        return entry[2]


def _warm_time(call) -> float:
    """Seconds of one call after an untimed one (first touch of the output, the BLAS's own buffers)."""
    call()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def rows_where_packed_wins(weight: torch.Tensor, packed: torch.Tensor, measure=None) -> int:
    """The most rows (MAX_ROWS, or one of CALIBRATION_ROWS) up to which the packed kernel beat torch's GEMM on
    this weight at torch's current thread count. The ladder stops at its first loss, measured twice: one slow call
    (a burst of page faults) once stopped it at 192 rows, where the kernel wins 1.7x. measure(rows) -> (packed
    seconds, torch seconds); tests inject it."""
    measure = measure or _measure_both(weight, packed)

    def packed_wins(rows: int) -> bool:
        packed_s, torch_s = measure(rows)
        return packed_s < torch_s

    best = MAX_ROWS
    for rows in (r for r in CALIBRATION_ROWS if r > MAX_ROWS):
        if not (packed_wins(rows) or packed_wins(rows)):
            break
        best = rows
    return best


def _measure_both(weight: torch.Tensor, packed: torch.Tensor):
    kernel = extension().packed_linear  # the kernel itself: the tests count the engine's calls of packed_linear

    def measure(rows: int) -> tuple[float, float]:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))  # not the user's RNG
        with torch.no_grad():
            return (_warm_time(lambda: kernel(x, packed, weight.shape[0], ISA == "avx512")),
                    _warm_time(lambda: F.linear(x, weight)))
    return measure


def packable_weights(model: torch.nn.Module, min_elements: int | None = None) -> list[torch.Tensor]:
    min_elements = MIN_ELEMENTS if min_elements is None else min_elements
    return [m.weight for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32
            and m.weight.device.type == "cpu" and m.weight.numel() >= min_elements]


class PackedLinearMode(TorchFunctionMode):
    """Within it, F.linear on a packed weight with a few float32 rows runs the packed kernel (this thread only)."""

    def __init__(self, weights: PackedWeights):
        super().__init__()
        self.weights = weights

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not torch.compiler.is_compiling():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            if (x.dtype == torch.float32 and x.device.type == "cpu"
                    and MIN_ROWS.get(ISA, 1) <= rows <= self.weights.max_rows):
                packed = self.weights.lookup(weight)
                if packed is not None:
                    return packed_linear(x, packed, weight.shape[0], bias)
        return func(*args, **kwargs)


def applied(weights: PackedWeights | None):
    """The mode over `weights`, or nothing to enter where the model has none."""
    import contextlib

    return PackedLinearMode(weights) if weights is not None else contextlib.nullcontext()


# ---- which models get it -------------------------------------------------------------------------------------------
_MODELS: "weakref.WeakKeyDictionary[torch.nn.Module, PackedWeights | None]" = weakref.WeakKeyDictionary()
_WARNED: set[str] = set()
_WHY_NOT: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def describe(model: torch.nn.Module) -> str:
    """One line for ssd_stats: the model's packed weights, or why it has none."""
    packed = _MODELS.get(model)
    if packed is not None:
        return packed.summary
    return "off: " + _WHY_NOT.get(model, "not asked for (ssd_packed_linear=False)")


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def weights_for(model: torch.nn.Module, wanted: bool | str = "auto",
                min_elements: int | None = None) -> PackedWeights | None:
    """The model's packed weights (packed on first use, kept for the model's life), or None where the packed
    kernel does not apply. wanted: False never; True packs every float32 CPU Linear of at least min_elements
    (raising if the kernel cannot run here); "auto" packs when the kernel runs, the model has such weights and
    the memory for their copy is free (else None, with one warning saying why)."""
    if wanted is False:
        return None
    if model in _MODELS and (_MODELS[model] is not None or wanted != True):  # noqa: E712 (True, not "auto")
        return _MODELS[model]
    weights = packable_weights(model, min_elements)
    if not weights:
        floor = MIN_ELEMENTS if min_elements is None else min_elements
        _WHY_NOT[model] = f"no float32 CPU Linear weight of at least {floor} elements (smaller ones stay in cache)"
        if wanted is True:
            raise ValueError(f"ssd_packed_linear=True: the model has no float32 CPU Linear weight of at least "
                             f"{floor} elements to pack; use 'auto' or False")
        _MODELS[model] = None
        return None
    if wanted is True:
        extension()  # raises with the reason
    else:
        reason = unavailable_reason()
        needed = sum(w.numel() * w.element_size() for w in {id(w): w for w in weights}.values())
        free = _available_memory()
        if reason is None and free is not None and free < needed + MEMORY_MARGIN_BYTES:
            reason = (f"its packed copy needs {needed / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free "
                      f"(set ssd_packed_linear=True to pack anyway)")
        if reason is not None:
            _WHY_NOT[model] = reason
            if reason not in _WARNED:
                _WARNED.add(reason)
                logger.warning("hf_ssd: few-row float32 forwards keep torch's GEMM (packed kernel off): %s", reason)
            _MODELS[model] = None
            return None
    packed = PackedWeights(model, min_elements)
    _MODELS[model] = packed
    return packed
