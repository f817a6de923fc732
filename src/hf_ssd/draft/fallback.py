"""The fallback chain, in one place: Saguaro -> synchronous SD -> plain target steps.

The draft side only proposes; the target decides. So when a drafter fails (an exception, a dead worker, a draft
that cannot even start), the generation goes on: warn once, close the failed drafter, build the next exact one and
restart it on the committed tokens. Every drafter in the chain yields the target's exact output law.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from hf_ssd.core.types import DraftResult, Speculation, Verdict
from hf_ssd.draft.protocol import Drafter
from hf_ssd.runtime.stats import SSDStats


class FallbackDrafter(Drafter):
    """Runs the first drafter of `chain` that works; on a failure moves to the next. The last should not fail."""

    def __init__(self, chain: Sequence[Callable[[], Drafter]], stats: SSDStats):
        self.chain, self.stats = list(chain), stats
        self.level = -1
        self.current: Drafter | None = None
        self.retired_forwards = 0
        self.needs_restart = False  # begin() failed: the next resolve restarts instead
        self._advance(None)

    @property
    def kind(self) -> str:
        return self.current.kind

    @property
    def forwards(self) -> int:
        return self.retired_forwards + self.current.forwards

    # ---- the protocol, guarded ------------------------------------------------------------------------------------
    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        while True:
            try:
                return self.current.start(prompt, mask)
            except Exception as exc:  # noqa: BLE001 - the draft side is advisory
                self._fail(exc)

    def prepare(self, prompt: torch.Tensor, mask: torch.Tensor) -> bool:
        try:
            return self.current.prepare(prompt, mask)
        except Exception as exc:  # noqa: BLE001 - start() then runs the next drafter of the chain
            self._fail(exc)
            return False

    def begin(self, spec: Speculation) -> None:
        if self.needs_restart:
            return
        try:
            self.current.begin(spec)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            self.needs_restart = True

    def send(self, verdict: Verdict) -> bool:
        if self.needs_restart:
            return False
        try:
            return self.current.send(verdict)
        except Exception as exc:  # noqa: BLE001 - resolve then restarts the next drafter of the chain
            self._fail(exc)
            self.needs_restart = True
            return False

    def resolve(self, verdict: Verdict) -> DraftResult:
        if not self.needs_restart:
            try:
                return self.current.resolve(verdict)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        self.needs_restart = False
        masks = verdict.masks()
        while True:
            try:
                return DraftResult(self.current.restart(verdict.contexts, masks))
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

    def retune(self, K: int) -> bool:
        return not self.needs_restart and self.current.retune(K)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()

    # ---- moving down the chain ------------------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        if self.level + 1 >= len(self.chain):
            raise exc
        failed = self.current.kind
        try:
            self.current.close()
        except Exception:  # noqa: BLE001 - it already failed; closing is best effort
            pass
        self.retired_forwards += self.current.forwards
        self._advance(exc, failed)

    def _advance(self, exc: Exception | None, failed: str | None = None) -> None:
        """Build the next drafter of the chain; a drafter that cannot even be built counts as a failure."""
        while True:
            if exc is not None:
                reason = f"{type(exc).__name__}: {exc}"
                self.stats.fallback_reason = reason
                warnings.warn(
                    f"hf_ssd: the draft side ({failed}) failed ({reason}); continuing on the exact fallback path. "
                    "Generated tokens are kept and the output distribution is unchanged.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self.level += 1
            try:
                self.current = self.chain[self.level]()
                return
            except Exception as build_exc:  # noqa: BLE001
                if self.level + 1 >= len(self.chain):
                    raise
                exc, failed = build_exc, "start-up"
