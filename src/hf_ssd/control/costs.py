"""What forwards cost on this machine: measured once per (model pair, batch, threads) per process.

A forward of n new tokens per row over a short cached prefix costs about `fixed + per_token·n`: the fixed part is
launches and weight reads (what dominates decoding), the per-token part is compute. A single token is its own
point: it runs matrix-vector kernels, and on the project's CPU the default pair's 1.5B target takes 0.37 s for one
token but 0.82 s for two, flat to 0.89 s at nine, so a line through 1 and 9 priced a 3-token verify at 0.50 s
instead of 0.78 and made small K look cheap. Three timings per model and thread setting (n = 1, 2 and n_max) give
the line and the point; everything the controller predicts (a verify of K+1 tokens, a tree of K steps over N
branches, K synchronous draft steps) is read off them.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_ssd.runtime.kv import cache_argument, input_device, position_limit


@dataclass(frozen=True)
class Line:
    """Seconds of one forward of `n` new tokens per row: fixed + per_token * n, and `one` for n = 1 where it was
    measured (None: the line holds there too)."""

    fixed: float
    per_token: float
    one: float | None = None

    def __call__(self, n: float) -> float:
        if n <= 1 and self.one is not None:
            return self.one
        return self.fixed + self.per_token * n

    @staticmethod
    def through(n1: int, t1: float, n2: int, t2: float) -> Line:
        per_token = max(0.0, (t2 - t1) / (n2 - n1))
        return Line(max(t1 - per_token * n1, 0.0), per_token)


@dataclass(frozen=True)
class Costs:
    """Measured cost lines of one model pair for one batch size, for the thread settings the plans use.

    `*_all`: the side runs alone with every thread (plain, sync SD, inline SSD); `*_split`: target and draft run at
    the same time, each on its share of the cores (concurrent SSD). On a GPU both are the same measurement.
    """

    batch: int
    target_all: Line
    draft_all: Line
    target_split: Line
    draft_split: Line
    split: tuple[int, int] | None  # (target threads, draft threads) of the split setting; None on a GPU
    draft_int8_all: Line | None = None
    draft_int8_split: Line | None = None
    probe_s: float = 0.0  # what measuring cost
    overlap: float = 1.0  # how much of the shorter side hides when both sides run in two threads (1 all, 0 none)

    def draft(self, split: bool, int8: bool) -> Line:
        if int8 and self.draft_int8_all is not None:
            return self.draft_int8_split if split else self.draft_int8_all
        return self.draft_split if split else self.draft_all

    def target(self, split: bool) -> Line:
        return self.target_split if split else self.target_all


def probe_ids(vocab: int, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Token ids to time forwards with, from a generator of their own: measuring must not move the caller's RNG
    (a seeded generate() draws the same samples whether or not this call measured the pair)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


def time_forward(model: PreTrainedModel, batch: int, n: int, prefix: int = 8, repeats: int = 2) -> float:
    """Best-of-`repeats` seconds of one forward of `n` new tokens per row after a cached `prefix`."""
    device = input_device(model)
    vocab = model.config.get_text_config().vocab_size
    limit = position_limit(model)
    if limit is not None:  # a learned position table: stay inside it (n itself is kept: it sets the line's slope)
        prefix = max(0, min(prefix, limit - n))
    ids = probe_ids(vocab, batch, prefix + n, device)
    best = float("inf")
    cache = DynamicCache()
    cache_kw = cache_argument(model)
    with torch.no_grad():
        if prefix:
            model(input_ids=ids[:, :prefix], use_cache=True, **{cache_kw: cache})
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids[:, prefix:], use_cache=True, **{cache_kw: cache})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
            cache.crop(-n)
    return best


def measure_line(model: PreTrainedModel, batch: int, n_max: int, threads: int | None, repeats: int = 1) -> Line:
    """The cost line of `model` from forwards of 2 and `n_max` tokens per row, with the single token's own time, on
    `threads` intra-op threads. (Each timing follows an untimed prefill of the same shapes, which warms the
    kernels.)"""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        t1 = time_forward(model, batch, 1, repeats=repeats)
        t2 = time_forward(model, batch, 2, repeats=repeats)
        line = Line.through(2, t2, n_max, time_forward(model, batch, n_max, repeats=repeats))
        return replace(line, one=t1)
    finally:
        torch.set_num_threads(before)


def _forwards(model: PreTrainedModel, batch: int, n: int, repeats: int, threads: int | None, ready, out: dict,
              key: str) -> None:
    """`repeats` forwards of n tokens per row after a short prefill; seconds from `ready` to the last one."""
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
                    n_verify: int = 5, n_tree: int = 8, repeats: int = 3) -> float:
    """Overlap efficiency of the thread worker: the target's verifies in this thread while the draft's tree steps
    run in another, against each alone. Python work holds the GIL, so small or launch-bound models overlap less
    than their forwards' times suggest; 1 = the shorter side hides entirely, 0 = the two run one after the other."""
    import threading

    def run(both: bool) -> dict:
        out: dict = {}
        ready = threading.Barrier(2 if both else 1)
        t, d = split if split is not None else (None, None)
        worker = threading.Thread(target=_forwards, args=(draft, batch, n_tree, repeats, d, ready, out, "d"))
        if both:
            worker.start()
        _forwards(target, batch, n_verify, repeats, t, ready, out, "t")
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
                  int8: bool = False) -> Costs:
    """Cost lines of the pair at this batch size, for the caller's thread setting (cached per process). About 16
    forwards of each model; the int8 option also makes the int8 copy once."""
    from hf_ssd.draft.quant import quantized_draft

    on_gpu = input_device(target).type == "cuda"
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    key = (id(target), id(draft), batch, n_max, int8, cores, threads)
    if key in _MEASURED:
        return _MEASURED[key]
    start = time.perf_counter()
    split = None if on_gpu else core_split(cores, threads)
    all_threads = None if on_gpu else threads
    t_all = measure_line(target, batch, 9, all_threads)
    d_all = measure_line(draft, batch, n_max, all_threads)
    t_split, d_split = t_all, d_all
    if split is not None:
        t_split = measure_line(target, batch, 9, split[0])
        d_split = measure_line(draft, batch, n_max, split[1])
    q_all = q_split = None
    if int8 and not on_gpu and input_device(draft).type == "cpu":
        q = quantized_draft(draft, "int8")
        q_all = measure_line(q, batch, n_max, all_threads)
        q_split = q_all if split is None else measure_line(q, batch, n_max, split[1])
    overlap = measure_overlap(target, draft, batch, split)
    costs = Costs(batch, t_all, d_all, t_split, d_split, split, q_all, q_split, time.perf_counter() - start, overlap)
    _MEASURED[key] = costs
    return costs
