"""What forwards cost on this machine: measured once per (model pair, batch, threads) per process.

A forward of n new tokens per row over a short cached prefix costs about `fixed + per_token·n` in principle: the
fixed part is launches and weight reads (what dominates decoding), the per-token part is compute. In practice the
kernels change with n. On the project's CPU the default pair's 1.5B target takes 0.37 s for 1 token, 0.80 s for 2,
1.15 s for 3 and 0.78 s for 4 (up to 0.89 s for 9): two and three rows run as that many matrix-vector products,
four and more as one matrix product. A line through 1 and 9 tokens priced a 3-token verify (K = 2) at 0.50 s
instead of 1.15 s. So every width a plan uses up to 9 is measured directly (`Curve`), one forward each after one
shared prefill, and wider forwards (tree steps of many branches) follow the last two points. Everything the
controller predicts (a verify of K+1 tokens, a tree of K steps over N branches, K synchronous draft steps) is
read off these curves.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_ssd.kernels.packed_linear import applied as packed_linear_applied
from hf_ssd.kernels.packed_linear import weights_for as packed_linear_weights
from hf_ssd.runtime.kv import cache_argument, input_device, position_limit


@dataclass(frozen=True)
class Curve:
    """Seconds of one forward of `n` new tokens per row, measured at `points` ((n, seconds), n increasing): read
    between them piecewise-linearly, and past the last one along the last two (never downhill)."""

    points: tuple[tuple[int, float], ...]

    def __call__(self, n: float) -> float:
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / (n1 - n0)) * (n - n1)

    @classmethod
    def straight(cls, fixed: float, per_token: float) -> Curve:
        """fixed + per_token * n for every n >= 0: synthetic costs (tests, examples of the model's arithmetic)."""
        return cls(((0, fixed), (1, fixed + per_token)))


@dataclass(frozen=True)
class Costs:
    """Measured cost lines of one model pair for one batch size, for the thread settings the plans use.

    `*_all`: the side runs alone with every thread (plain, sync SD, inline SSD); `*_split`: target and draft run at
    the same time, each on its share of the cores (concurrent SSD). On a GPU both are the same measurement.
    """

    batch: int
    target_all: Curve
    draft_all: Curve
    target_split: Curve
    draft_split: Curve
    split: tuple[int, int] | None  # (target threads, draft threads) of the split setting; None on a GPU
    draft_int8_all: Curve | None = None
    draft_int8_split: Curve | None = None
    probe_s: float = 0.0  # what measuring cost
    overlap: float = 1.0  # how much of the shorter side hides when both sides run in two threads (1 all, 0 none)

    def plain_step(self) -> float:
        """A step of plain decoding: the controller's plain hand-off runs transformers' loop with the same packed
        linear kernel (kernels/packed_linear) as our one-token forward."""
        return self.target_all(1)

    def draft(self, split: bool, int8: bool) -> Curve:
        if int8 and self.draft_int8_all is not None:
            return self.draft_int8_split if split else self.draft_int8_all
        return self.draft_split if split else self.draft_all

    def target(self, split: bool) -> Curve:
        return self.target_split if split else self.target_all


def probe_ids(vocab: int, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Token ids to time forwards with, from a generator of their own: measuring must not move the caller's RNG
    (a seeded generate() draws the same samples whether or not this call measured the pair)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


WIDTHS = (1, 2, 3, 4, 6, 9)  # forward widths timed per model: every verify of K + 1 <= 9 tokens reads off them


def time_widths(model: PreTrainedModel, batch: int, widths: tuple[int, ...], prefix: int = 8,
                packed: bool = True) -> dict[int, float]:
    """Seconds of one forward of each of `widths` new tokens per row, after one cached `prefix` (an untimed prefill)
    and one untimed forward of one token; each forward's tokens are cropped off before the next. packed: as our
    engine runs them, through the packed linear kernel where the model has packed weights (False: torch's own
    GEMM, as transformers' loop runs)."""
    with packed_linear_applied(packed_linear_weights(model) if packed else None):
        return _time_widths(model, batch, widths, prefix)


def _time_widths(model: PreTrainedModel, batch: int, widths: tuple[int, ...], prefix: int) -> dict[int, float]:
    device = input_device(model)
    vocab = model.config.get_text_config().vocab_size
    limit = position_limit(model)
    if limit is not None:  # a learned position table: stay inside it
        prefix = max(0, min(prefix, limit - max(widths)))
    ids = probe_ids(vocab, batch, prefix + max(widths), device)
    cache = DynamicCache()
    cache_kw = cache_argument(model)
    seconds = {}
    with torch.no_grad():
        if prefix:
            model(input_ids=ids[:, :prefix], use_cache=True, **{cache_kw: cache})
        # an untimed first decode-shaped forward: the first one after a prefill sets up the kernels for its shape,
        # and timed, it priced the default pair's one-token step 35% over what plain decoding then ran at
        model(input_ids=ids[:, prefix:prefix + 1], use_cache=True, **{cache_kw: cache})
        cache.crop(-1)
        for n in widths:
            start = time.perf_counter()
            model(input_ids=ids[:, prefix:prefix + n], use_cache=True, **{cache_kw: cache})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[n] = time.perf_counter() - start
            cache.crop(-n)
    return seconds


def measure_curve(model: PreTrainedModel, batch: int, n_max: int, threads: int | None, passes: int = 1,
                  packed: bool = True) -> Curve:
    """The cost curve of `model` at WIDTHS and `n_max` tokens per row, on `threads` intra-op threads: the fastest
    of `passes` timings per width (a one-thread forward of the default pair varies by ±15% from pass to pass, and
    the slow passes are the machine's interruptions, not the forward)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        widths = tuple(sorted({w for w in WIDTHS if w <= n_max} | {n_max}))
        timings = [time_widths(model, batch, widths, packed=packed) for _ in range(passes)]
        return Curve(tuple((w, min(t[w] for t in timings)) for w in widths))
    finally:
        torch.set_num_threads(before)


def measure_curves(batch: int, wanted: list[tuple[PreTrainedModel, int, int | None]],
                   packed: bool = True) -> list[Curve]:
    """A curve for each (model, n_max, threads) in `wanted`. A setting asked for twice (the paper setting's split
    gives the target the one thread it already has) is timed once with two passes, not twice for two curves: the
    same forwards, a steadier curve."""
    asked: dict[tuple, int] = {}
    for model, _, threads in wanted:
        asked[(id(model), threads)] = asked.get((id(model), threads), 0) + 1
    curves: dict[tuple, Curve] = {}
    for model, n_max, threads in wanted:
        key = (id(model), threads)
        if key not in curves:
            curves[key] = measure_curve(model, batch, n_max, threads, passes=asked[key], packed=packed)
    return [curves[(id(model), threads)] for model, _, threads in wanted]


def _forwards(model: PreTrainedModel, batch: int, n: int, repeats: int, threads: int | None, ready, out: dict,
              key: str, packed: bool = True) -> None:
    """`repeats` forwards of n tokens per row after a short prefill; seconds from `ready` to the last one. packed:
    through the packed linear kernel, as the engine runs them, where the model has packed weights (the rounds'
    forwards are packed, so their overlap and speed are measured packed)."""
    with packed_linear_applied(packed_linear_weights(model) if packed else None):
        _unpacked_forwards(model, batch, n, repeats, threads, ready, out, key)


def _unpacked_forwards(model: PreTrainedModel, batch: int, n: int, repeats: int, threads: int | None, ready,
                       out: dict, key: str) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    device = input_device(model)
    ids = probe_ids(model.config.get_text_config().vocab_size, batch, 8 + n, device)
    cache, kw = DynamicCache(), cache_argument(model)
    with torch.no_grad():
        model(input_ids=ids[:, :8], use_cache=True, **{kw: cache})
        ready.wait()
        start = time.perf_counter()
        for _ in range(repeats):
            model(input_ids=ids[:, 8:], use_cache=True, **{kw: cache})
            cache.crop(-n)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    out[key] = time.perf_counter() - start


def measure_overlap(target: PreTrainedModel, draft: PreTrainedModel, batch: int, split: tuple[int, int] | None,
                    n_verify: int = 5, n_tree: int = 8, repeats: int = 3, packed: bool = True) -> float:
    """Overlap efficiency of the thread worker: the target's verifies in this thread while the draft's tree steps
    run in another, against each alone. Python work holds the GIL, so small or launch-bound models overlap less
    than their forwards' times suggest; 1 = the shorter side hides entirely, 0 = the two run one after the other."""
    import threading

    def run(both: bool) -> dict:
        out: dict = {}
        ready = threading.Barrier(2 if both else 1)
        t, d = split if split is not None else (None, None)
        worker = threading.Thread(target=_forwards, args=(draft, batch, n_tree, repeats, d, ready, out, "d", packed))
        if both:
            worker.start()
        _forwards(target, batch, n_verify, repeats, t, ready, out, "t", packed)
        if both:
            worker.join()
        else:
            worker.run()  # alone, after the target (a Barrier of 1 passes at once)
        return out

    before = torch.get_num_threads()
    try:
        alone, together = run(False), run(True)
    finally:
        torch.set_num_threads(before)
    short, long_ = sorted((alone["t"], alone["d"]))
    wall = max(together["t"], together["d"])
    if short <= 0:
        return 1.0
    return min(1.0, max(0.0, (short + long_ - wall) / short))


def core_split(cores: int, target_threads: int) -> tuple[int, int] | None:
    """(target, draft) threads when both sides run at once: cores the target leaves idle go to the draft; if it uses
    them all, the target keeps the larger share."""
    if cores < 2:
        return None
    if target_threads < cores:
        return target_threads, cores - target_threads
    draft = max(1, cores // 3)
    return cores - draft, draft


_MEASURED: dict[tuple, Costs] = {}


def measure_costs(target: PreTrainedModel, draft: PreTrainedModel, batch: int, *, n_max: int = 16,
                  int8: bool = False, packed: bool = True) -> Costs:
    """Cost curves of the pair at this batch size, for the caller's thread setting (cached per process). About 20
    forwards of each model (6-7 widths after one prefill, per thread setting, and the overlap probe; a thread
    setting that comes up twice gets two passes instead); the int8 option also makes the int8 copy once."""
    from hf_ssd.draft.quant import quantized_draft

    on_gpu = input_device(target).type == "cuda"
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    key = (id(target), id(draft), batch, n_max, int8, cores, threads, packed)
    if key in _MEASURED:
        return _MEASURED[key]
    start = time.perf_counter()
    split = None if on_gpu else core_split(cores, threads)
    all_threads = None if on_gpu else threads
    quantized = int8 and not on_gpu and input_device(draft).type == "cpu"
    drafts = [draft, quantized_draft(draft, "int8")] if quantized else [draft]
    wanted = [(target, 9, all_threads)] + [(d, n_max, all_threads) for d in drafts]
    if split is not None:
        wanted += [(target, 9, split[0])] + [(d, n_max, split[1]) for d in drafts]
    curves = iter(measure_curves(batch, wanted, packed))
    t_all, d_all = next(curves), next(curves)
    q_all = next(curves) if quantized else None
    t_split, d_split, q_split = t_all, d_all, q_all
    if split is not None:
        t_split, d_split = next(curves), next(curves)
        q_split = next(curves) if quantized else None
    overlap = measure_overlap(target, draft, batch, split, packed=packed)
    costs = Costs(batch, t_all, d_all, t_split, d_split, split, q_all, q_split, time.perf_counter() - start, overlap)
    _MEASURED[key] = costs
    return costs
