"""Synchronous speculative decoding's draft side: K autoregressive draft steps after every verification.

It is the baseline SSD must beat and the exact path SSD falls back to when its own draft side fails.
"""
from __future__ import annotations

import torch

from hf_ssd.core.device_span import DeviceSpan
from hf_ssd.core.types import DraftResult, Speculation, Verdict
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.protocol import Drafter
from hf_ssd.runtime.stats import SSDStats


class SyncDrafter(Drafter):
    kind = "sync"

    def __init__(self, draft: DraftModel, K: int, stats: SSDStats, max_K: int | None = None):
        """max_K: the most drafts per round the draft's cache has room for (a static cache is sized for it,
        runtime.static_kv.static_cache_len); None: K for a static cache, unbounded for a dynamic one."""
        self.draft, self.K, self.stats = draft, K, stats
        self.max_K = max_K if max_K is not None else (K if getattr(draft.kv, "static", False) else None)
        self.span: tuple[DeviceSpan, int] | None = None  # the last draft's device time, and its number of steps

    @property
    def forwards(self) -> int:
        return self.draft.kv.forwards

    def _draft(self, pending: torch.Tensor, pending_valid: torch.Tensor) -> Speculation:
        t0 = self.stats.now()
        span = DeviceSpan(self.draft.kv.device)
        self.first_draft_slot = self.draft.kv.write_pointer() + pending.shape[1]  # [B]: static rows advance apart
        self.spec = self.draft.jit(pending, pending_valid, self.K)
        self.span = (span.stop(), self.K)
        kv = self.draft.kv
        if getattr(kv, "static", False):  # ssd_compile: say whether the draft steps ran compiled, and at what cost
            self.stats.draft_static = True
            self.stats.draft_compiled = kv.compiled_calls > 0
            self.stats.draft_compile_s = round(kv.compile_s, 4)
        self.draft_span = (t0, self.stats.now())
        return self.spec

    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        self.draft.prefill(prompt, mask)
        last = prompt[:, -1:].to(self.draft.kv.device)
        return self._draft(last, torch.ones_like(last, dtype=torch.bool))

    def retune(self, K: int) -> bool:
        """Only the number of draft steps changes: the cache holds the same committed tokens whatever K was."""
        if K < 1 or (self.max_K is not None and K > self.max_K):
            return False
        self.K = K
        return True

    def _verified_draft_s(self) -> float | None:
        """Device seconds of the draft this round verified (done: its tokens were verified and committed), where
        it drafted as many steps as the next one will (a retune in between changes K): read one round late, so a
        GPU's draft is timed by its events without a sync before the verify."""
        if self.span is None or self.span[1] != self.K:
            return None
        return self.span[0].seconds()

    def resolve(self, verdict: Verdict) -> DraftResult:
        drafted_s = self._verified_draft_s()
        kv, K = self.draft.kv, self.spec.tokens.shape[1]  # the verified speculation's K (retune may have moved it)
        k = verdict.outcome.accepted.to(kv.device)
        # The cache holds pending + d_1..d_{K-1}; keep the accepted drafts among them.
        kv.invalidate(self.first_draft_slot + k.clamp_max(K - 1))
        full = k == K  # d_K was accepted but never fed: it goes in front of the bonus
        d_last = self.spec.tokens[:, -1].to(kv.device)
        pending = torch.stack([d_last, verdict.outcome.bonus.to(kv.device)], dim=1)
        pending_valid = torch.stack([full, torch.ones_like(full)], dim=1)
        rows = verdict.keep.nonzero().squeeze(1).to(kv.device)
        kv.select_rows(rows)
        spec = self._draft(pending[rows], pending_valid[rows])
        return DraftResult(spec, draft_span=self.draft_span, draft_s=drafted_s)

    def close(self) -> None:
        # a static cache goes back to the registry now, not whenever garbage collection gets to it: the next
        # generate() with these shapes then reuses its buffers and compiled graphs instead of building new ones
        release = getattr(self.draft.kv, "release", None)
        if release is not None:
            release()


class NullDrafter(Drafter):
    """Proposes nothing: every round is one plain target step. The last resort when the draft model itself fails."""

    kind = "none"

    def __init__(self, K: int, device: torch.device):
        self.K, self.device = K, device

    def _empty(self, batch: int) -> Speculation:
        zeros = torch.zeros(batch, dtype=torch.long, device=self.device)
        return Speculation(torch.zeros(batch, self.K, dtype=torch.long, device=self.device), zeros, None, zeros)

    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        return self._empty(prompt.shape[0])

    def restart(self, contexts: list[torch.Tensor], masks: list[torch.Tensor]) -> Speculation:
        return self._empty(len(contexts))

    def resolve(self, verdict: Verdict) -> DraftResult:
        return DraftResult(self._empty(int(verdict.keep.sum())))
