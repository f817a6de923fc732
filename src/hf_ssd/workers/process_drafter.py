"""The parent's side of a draft process, as a drafter: each protocol call becomes a message to the child
(`workers.process.DraftProcess`), and each round's tensors go through the generation's shared buffers (`Exchange`).
`begin` is not answered, so the child builds the speculation cache while the target verifies; `send` hands the
round's outcome over before the caller's own bookkeeping, which then overlaps the child's lookup."""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from hf_ssd.config import SSDConfig
from hf_ssd.core.types import DraftResult, Speculation, Verdict
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.protocol import Drafter
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.workers.exchange import Exchange
from hf_ssd.workers.process import SHARED_STATS, DraftProcess

CONTEXT_CAPACITY = 256  # initial tokens per row of the shared contexts buffer (twice the prompt if longer)


class Sent(NamedTuple):
    """A round's outcome on its way to the child: its message number, the rows kept, the longest context, what
    sending took and when it ended."""
    seq: int
    kept: int
    longest: int
    cost_s: float
    at: float


class ProcessDrafter(Drafter):
    kind = "process"

    def __init__(self, draft: DraftModel, config: SSDConfig, stats: SSDStats, budget: int, greedy: bool,
                 process: DraftProcess | None = None, max_length: int | None = None):
        self.stats = stats
        self.remote_forwards = 0
        self.vocab, self.greedy = draft.vocab_size, greedy
        self.exchange: Exchange | None = None  # this generation's shared buffers (allocated at start)
        self.starting: int | None = None  # the sequence number of a start sent by prepare(), not yet answered
        self.sent: Sent | None = None  # a round's outcome sent by send(), not yet answered
        self.owned = process is None
        self.worker = DraftProcess(draft.kv.model) if process is None else process
        self.worker.acquire()  # one generation at a time; restarts a process an interrupted call left out of step
        try:
            rng_state = None if draft.generator is None else draft.generator.get_state()
            self.worker.call("setup", draft.vocab_size, draft.warpers, greedy, draft.downweight, rng_state,
                             config.to_dict(), budget, stats.started, config.draft_threads, draft.kv.batch,
                             max_length)
        except BaseException:
            self.close()
            raise

    @property
    def forwards(self) -> int:
        return self.remote_forwards

    def prepare(self, prompt: torch.Tensor, mask: torch.Tensor) -> bool:
        # The child prefills the draft while the parent prefills the target: a call's first token then waits for
        # the slower of the two prefills, not their sum. start() collects the answer.
        self.starting = self._send_start(prompt, mask)
        return True

    def _send_start(self, prompt: torch.Tensor, mask: torch.Tensor) -> int:
        # Copies: sending a CPU tensor moves its storage to shared memory in place (one open file per tensor in
        # the file_descriptor strategy), and the caller's input_ids must not be turned into that.
        return self.worker.send("start", prompt.cpu().clone(), mask.cpu().clone())

    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        seq, self.starting = self.starting, None
        if seq is None:  # not prepared (a restart after a fallback or a switch)
            seq = self._send_start(prompt, mask)
        spec = self.worker._answer("start", seq)
        # The rounds' buffers, sized for this batch, allocated and sent once (see Exchange).
        q_dtype = None if self.greedy else (torch.float32 if spec.q is None else spec.q.dtype)
        self.exchange = None
        exchange = Exchange(prompt.shape[0], spec.tokens.shape[1], self.vocab, q_dtype,
                            max(CONTEXT_CAPACITY, 2 * prompt.shape[1]))
        self.worker.call("exchange", *exchange.message())
        self.exchange = exchange
        return spec

    def begin(self, spec: Speculation) -> None:
        self.worker.send("begin", self.exchange.write_spec(spec))

    def send(self, verdict: Verdict) -> bool:
        self.sent = self._send_verdict(verdict)
        return True

    def _send_verdict(self, verdict: Verdict) -> Sent:
        t0 = time.perf_counter()
        exchange = self.exchange
        longest = max(c.shape[0] for c in verdict.contexts)
        if longest > exchange.capacity:  # not foreseen below (waits for the tree build: a call is answered in order)
            self.worker.call("contexts", exchange.grow(longest))
        rows, kept = exchange.write_verdict(verdict)
        seq = self.worker.send("resolve", rows, kept, verdict.verify_s)
        at = time.perf_counter()
        return Sent(seq, kept, longest, at - t0, at)

    def resolve(self, verdict: Verdict) -> DraftResult:
        sent, self.sent = self.sent, None
        if sent is None:
            sent = self._send_verdict(verdict)
        collecting = time.perf_counter()
        exchange = self.exchange
        (out_rows, has_q, has_hits, backup, draft_span, draft_s, info, self.remote_forwards, compute_s,
         begin_end) = self.worker._answer("resolve", sent.seq)
        if out_rows != sent.kept:
            raise RuntimeError(f"the draft process returned {out_rows} rows for {sent.kept} kept rows")
        for name in SHARED_STATS:
            setattr(self.stats, name, info[name])
        spec, hits = exchange.read_result(out_rows, has_q, has_hits)
        if sent.longest + exchange.K + 1 > exchange.capacity:
            # Rare: the next round's contexts (at most K + 1 tokens longer) may not fit. Grow now, while the child
            # is idle: the larger buffer is sent once, answered at once.
            self.worker.call("contexts", exchange.grow(sent.longest + exchange.K + 1))
        # Hand-over: sending, plus the wait for the answer beyond the child's own resolve and any wait for its tree
        # build to end, or beyond the caller's own work between send and resolve, whichever ended later.
        waited = 0.0 if begin_end is None else max(0.0, begin_end - sent.at)
        busy = max(compute_s + waited, collecting - sent.at)
        handover = sent.cost_s + max(0.0, time.perf_counter() - sent.at - busy)
        return DraftResult(spec, hits=hits, backup=backup, draft_span=draft_span, draft_s=draft_s,
                           handover_s=handover)

    def _answering(self) -> bool:
        """Can the child still be asked something (alive, the pipe in step, not closed)?"""
        worker = self.worker
        return worker.process.is_alive() and worker._broken is None and not worker.closed

    def close(self) -> None:
        self.exchange = None  # frees this generation's shared memory (and its file descriptors) in the parent
        try:
            try:  # the stats the child's last round changed (it learns after answering)
                if self._answering():
                    for name, value in self.worker.call("stats").items():
                        setattr(self.stats, name, value)
            except Exception:  # noqa: BLE001 - a failed child has nothing more to say; the output is complete
                pass
            if self.owned:
                self.worker.close()
                return
            try:  # a kept worker stays up for the next generation, without this one's caches
                if self._answering():
                    self.worker.call("release")
            except Exception:
                pass
        finally:
            self.worker.release()
