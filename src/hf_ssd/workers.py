"""Where the draft side runs. The engine only calls start / begin / resolve / close; a worker decides whether the
tree build of `begin` runs inline (the exact reference), in a thread (own CUDA stream on GPU), or in a process.

`begin` returns at once in the concurrent workers: the target verifies while the draft builds the speculation
cache; `resolve` waits for the build, so results are identical to inline.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import warnings

import torch

from .config import SSDConfig
from .draft import DraftModel
from .stats import SSDStats


def default_worker(device: torch.device) -> str:
    """Thread on CPU with two or more cores and on GPU (own stream); inline on a single core."""
    if device.type == "cuda":
        return "thread"
    return "thread" if (os.cpu_count() or 1) >= 2 else "inline"


def make_drafter(config: SSDConfig, draft: DraftModel, stats: SSDStats, budget: int, greedy: bool, process=None):
    from .saguaro import SaguaroDrafter

    kind = config.worker if config.worker != "auto" else default_worker(draft.kv.device)
    stats.worker = kind
    if kind == "process":
        from .process_worker import ProcessDrafter

        return ProcessDrafter(draft, config, stats, budget, greedy, process)
    inner = SaguaroDrafter(draft, config, stats, budget, greedy)
    if kind == "thread":
        return ThreadDrafter(inner, config.draft_threads)
    return inner


class ThreadDrafter:
    """Runs the Saguaro tree build in a background thread while the caller's thread runs the target."""

    kind = "thread"

    def __init__(self, inner, draft_threads: int | None):
        self.inner = inner
        self.draft_threads = draft_threads
        self.pending: concurrent.futures.Future | None = None
        device = inner.draft.kv.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hf-ssd-draft", initializer=self._init_thread
        )

    def _init_thread(self) -> None:
        if self.draft_threads is not None:
            torch.set_num_threads(self.draft_threads)

    def _on_stream(self, fn, *args):
        torch.set_grad_enabled(False)
        if self.stream is None:
            return fn(*args)
        with torch.cuda.stream(self.stream):
            return fn(*args)

    def _sync(self, future: concurrent.futures.Future):
        result = future.result()  # re-raises the worker's exception in the caller
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return result

    def __getattr__(self, name):  # stats read by the engine (last_hits, draft_span, ...)
        return getattr(self.inner, name)

    def start(self, prompt, mask):
        return self._sync(self.pool.submit(self._on_stream, self.inner.start, prompt, mask))

    def begin(self, spec) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self.pending = self.pool.submit(self._on_stream, self.inner.begin, spec)

    def resolve(self, outcome, keep, contexts):
        pending, self.pending = self.pending, None
        if pending is not None:
            self._sync(pending)
        return self._sync(self.pool.submit(self._on_stream, self.inner.resolve, outcome, keep, contexts))

    def close(self) -> None:
        pending, self.pending = self.pending, None
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.inner.close()
        if pending is not None and not pending.cancelled() and pending.exception() is not None:
            # The failed build was for a round no one needs any more: the output is complete; still say so.
            exc = pending.exception()
            warnings.warn(f"hf_ssd: the draft side (thread) failed in the last round ({type(exc).__name__}: {exc}); "
                          "the output is complete and unaffected.", RuntimeWarning, stacklevel=2)


def live_worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hf-ssd-draft")]
