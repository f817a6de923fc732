"""The small types every layer passes around: a speculation, a verification outcome, the forks of a tree.

Shapes: B rows, K draft slots, V vocabulary, N branches per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Where a row's speculation came from; the verifier treats them alike, the fan-out and backup policy learn per source.
SOURCE_CACHE, SOURCE_JIT, SOURCE_NGRAM = 0, 1, 2
SOURCE_NAMES = {SOURCE_CACHE: "cache", SOURCE_JIT: "jit", SOURCE_NGRAM: "ngram"}


@dataclass
class Speculation:
    """The next K draft tokens of each row and the exact distributions they were drawn from."""

    tokens: torch.Tensor  # [B, K] long (slots past n are padding)
    n: torch.Tensor  # [B] long, real drafts per row
    q: torch.Tensor | None  # [B, K, V] float, None when decoding greedily
    source: torch.Tensor  # [B] long, SOURCE_*

    @staticmethod
    def merge(parts: list[tuple[torch.Tensor, "Speculation"]], batch: int) -> "Speculation":
        """Assemble a batch from (row indices, speculation for those rows) pieces."""
        first = parts[0][1]
        K = first.tokens.shape[1]
        tokens = torch.zeros(batch, K, dtype=torch.long, device=first.tokens.device)
        n = torch.zeros(batch, dtype=torch.long, device=first.tokens.device)
        source = torch.zeros(batch, dtype=torch.long, device=first.tokens.device)
        q = None if first.q is None else first.q.new_zeros(batch, K, first.q.shape[-1])
        for rows, spec in parts:
            if rows.numel() == 0:
                continue
            tokens[rows], n[rows], source[rows] = spec.tokens, spec.n, spec.source
            if q is not None:
                q[rows] = spec.q
        return Speculation(tokens, n, q, source)


@dataclass
class Outcome:
    """What verification decided per row: the key (k, t*) of the speculation cache."""

    accepted: torch.Tensor  # [B] long, k in 0..n_drafts
    bonus: torch.Tensor  # [B] long, the token drawn at position k


@dataclass
class Forks:
    """The branches of a speculation tree: branch i of row b guesses bonus `tokens[b, i]` after `depth[b, i]`
    accepted drafts."""

    tokens: torch.Tensor  # [B, N] guessed bonus token of each branch
    depth: torch.Tensor  # [B, N] j: drafts the branch assumes accepted
    valid: torch.Tensor  # [B, N] bool; rows with fewer branches are padded


@dataclass
class Verdict:
    """What the target decided about the speculation being verified; the engine hands it to `Drafter.resolve`."""

    outcome: Outcome  # per row of the verified batch
    keep: torch.Tensor  # [B] bool: rows still generating after this round's commit
    contexts: list[torch.Tensor]  # committed tokens of each kept row (1D, its left padding included)
    prompt_masks: list[torch.Tensor]  # attention mask of each kept row's prompt (everything after it is real)
    verify_s: float  # seconds this round's verify took (the backup policy compares costs against it)

    def masks(self) -> list[torch.Tensor]:
        """Attention masks of `contexts` (needed only when a drafter restarts on them)."""
        return [torch.cat([m, m.new_ones(c.shape[0] - m.shape[0])]) for c, m in zip(self.contexts, self.prompt_masks)]


@dataclass
class DraftResult:
    """What `Drafter.resolve` returns: the next speculation and what it took to get it."""

    spec: Speculation  # for the kept rows, in order
    hits: torch.Tensor | None = None  # [B'] bool per kept row: outcome found in the speculation cache (None: no cache)
    backup: str | None = None  # backup kind that served the rows that missed ("jit" / "ngram"), None if none did
    draft_span: tuple[float, float] | None = None  # (start, end) of the round's draft work, seconds on stats' clock
    # seconds of device work of the draft this round used (its tree, or the synchronous draft it verified): the
    # span's length on a CPU, CUDA events on a GPU, where the span times only the launches (core.device_span)
    draft_s: float | None = None
    handover_s: float | None = None  # seconds resolve spent handing data to and from a worker (None: inline)
