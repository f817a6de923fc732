"""The drafter protocol: every call the engine makes to the draft side, with shapes.

One round, as the engine sees it:

    drafter.prepare(prompt, mask)                   # once, before the target's prefill (may start concurrently)
    spec = drafter.start(prompt, mask)              # once, after it: the first speculation
    loop:
        drafter.begin(spec)                         # spec is about to be verified (concurrent drafters start work)
        verdict = <target verifies spec, tokens are committed>
        drafter.send(verdict)                       # optional: a drafter elsewhere starts on the outcome now
        result = drafter.resolve(verdict)           # the next speculation for the rows still generating
        spec = result.spec
    drafter.close()

Shapes: B rows of the batch being verified, B' <= B rows kept after the round, K draft slots, V vocabulary.
Drafters write their own counters (cache hits, backup rounds, fan-out) into the `SSDStats` they were given; what
the engine needs back each round comes in the `DraftResult`. A drafter may raise from any call: the engine's
drafter is wrapped in `FallbackDrafter`, which moves to the next exact drafter without losing a token.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hf_ssd.core.padding import left_pad
from hf_ssd.core.types import DraftResult, Speculation, Verdict


class Drafter(ABC):
    kind: str = "?"  # names the drafter in stats and warnings: "ssd", "sync", "none", "thread", "process"

    @abstractmethod
    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        """Prefill on the prompt and return the first speculation.

        prompt: [B, L] long, left-padded; mask: [B, L] (1 = real token). Returns a Speculation of B rows.
        """

    def prepare(self, prompt: torch.Tensor, mask: torch.Tensor) -> bool:
        """Called once before the target's prefill, with the arguments `start` will get. A drafter that runs
        elsewhere (a draft process) begins its start here, so the draft's prefill overlaps the target's; True when
        it did. The default does nothing: `start` then does all of it, after the target's prefill."""
        return False

    def restart(self, contexts: list[torch.Tensor], masks: list[torch.Tensor]) -> Speculation:
        """Start over on committed tokens (after another drafter failed): contexts[b] is row b's 1D token history,
        masks[b] its attention mask. Returns a Speculation of len(contexts) rows."""
        prompt, mask = left_pad(contexts, masks)
        return self.start(prompt, mask)

    def begin(self, spec: Speculation) -> None:
        """`spec` (B rows) is being verified now. Concurrent drafters build the speculation cache here and return
        at once; the default does nothing."""

    @abstractmethod
    def resolve(self, verdict: Verdict) -> DraftResult:
        """Take the round's outcome (k accepted, bonus t* per row) and return the next speculation for the rows
        with `verdict.keep` set, in order. Between rounds the drafter's cache holds every committed token except
        the last bonus, which leads the next draft block."""

    def send(self, verdict: Verdict) -> bool:
        """Hand the round's outcome over now; the `resolve(verdict)` that follows collects the answer. A drafter
        that runs elsewhere (a process, a thread) starts its lookup here, so what the caller does in between (the
        controller's bookkeeping) overlaps it. False where nothing was sent: resolve then does all of it."""
        return False

    def retune(self, K: int) -> bool:
        """Draft K tokens per round from the next resolve on, keeping the cache (no restart, no prefill). False
        when this drafter cannot (the caller then builds a new one); the default cannot."""
        return False

    def close(self) -> None:
        """Release caches, threads or processes. Called once, also after a failure."""

    @property
    def forwards(self) -> int:
        """Draft-model forward passes run so far (stats)."""
        return 0
