"""The thread worker: the Saguaro tree build runs in a background thread (its own CUDA stream on GPU) while the
caller's thread runs the target's verify. `resolve` waits for the build, so results are identical to inline."""
from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings

import torch

from hf_ssd.core.types import DraftResult, Speculation, Verdict
from hf_ssd.draft.protocol import Drafter


class ThreadDrafter(Drafter):
    """Runs the Saguaro tree build in a background thread while the caller's thread runs the target."""

    kind = "thread"

    def __init__(self, inner, draft_threads: int | None):
        self.inner = inner
        self.draft_threads = draft_threads
        self.pending: concurrent.futures.Future | None = None
        self.starting: concurrent.futures.Future | None = None  # a start prepare() began on the draft's stream
        self.sent: tuple[concurrent.futures.Future, float] | None = None  # send()'s resolve and when it was queued
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
        try:
            if self.stream is None:
                return fn(*args)
            with torch.cuda.stream(self.stream):
                return fn(*args)
        except SystemExit as exc:  # a draft-side exit is a draft failure, not the caller's: fall back, as a process does
            raise RuntimeError(f"the draft thread called exit ({exc.code!r})") from exc

    def _sync(self, future: concurrent.futures.Future):
        result = future.result()  # re-raises the worker's exception in the caller
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return result

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    def prepare(self, prompt: torch.Tensor, mask: torch.Tensor) -> bool:
        # On a GPU the draft prefills on its own stream while the target prefills on the caller's: the two sides'
        # launches interleave. On a CPU they would share the cores and the GIL, so start() runs it after.
        if self.stream is None:
            return False
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # the prompt was made on that one
        self.starting = self.pool.submit(self._on_stream, self.inner.start, prompt, mask)
        return True

    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        starting, self.starting = self.starting, None
        if starting is not None:
            return self._sync(starting)
        # The prefill runs alone (the caller waits for it), so on the caller's threads, not the draft's share.
        threads = torch.get_num_threads()
        return self._sync(self.pool.submit(self._alone, threads, self.inner.start, prompt, mask))

    def _alone(self, threads: int, fn, *args):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return self._on_stream(fn, *args)
        finally:
            torch.set_num_threads(before)

    def begin(self, spec: Speculation) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self.pending = self.pool.submit(self._timed, self.inner.begin, spec)

    def send(self, verdict: Verdict) -> bool:
        # queued behind the tree build (one worker thread): the lookup starts the moment the build ends
        self.sent = (self.pool.submit(self._timed, self.inner.resolve, verdict), time.perf_counter())
        return True

    def resolve(self, verdict: Verdict) -> DraftResult:
        pending, self.pending = self.pending, None
        built = self._sync(pending)[2] if pending is not None else 0.0
        sent, self.sent = self.sent, None
        collecting = time.perf_counter()
        if sent is None:
            sent = (self.pool.submit(self._timed, self.inner.resolve, verdict), collecting)
        future, at = sent
        result, began, ended = self._sync(future)
        # Hand-over: the hops to the worker thread (once both the outcome and the thread were there) and back (once
        # the caller came for it; and the stream sync), not the resolve itself nor the caller's work in between.
        result.handover_s = max(0.0, began - max(at, built)) + max(0.0, time.perf_counter() - max(ended, collecting))
        return result

    def _timed(self, fn, *args):
        """fn(*args) on the draft's stream, with when it began and ended."""
        began = time.perf_counter()
        result = self._on_stream(fn, *args)
        return result, began, time.perf_counter()

    def close(self) -> None:
        pending, self.pending = self.pending, None
        self.sent = None
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.inner.close()
        if pending is not None and not pending.cancelled() and pending.exception() is not None:
            # The failed build was for a round no one needs any more: the output is complete; still say so.
            exc = pending.exception()
            warnings.warn(f"hf_ssd: the draft side (thread) failed in the last round ({type(exc).__name__}: {exc}); "
                          "the output is complete and unaffected.", RuntimeWarning, stacklevel=2)


def live_worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hf-ssd-draft")]
