"""Left padding: stack rows of different lengths into one batch, the layout transformers' decoder-only models use."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(
    rows: Sequence[torch.Tensor | Sequence[int]],
    masks: Sequence[torch.Tensor] | None = None,
    pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L] long ids, [B, L] bool mask) with each row right-aligned; `masks` (per row, default all ones) keeps
    padding a row already had inside it."""
    rows = [torch.as_tensor(r, dtype=torch.long) for r in rows]
    L = max(r.shape[0] for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, L - r.shape[0]:] = r
        mask[b, L - r.shape[0]:] = True if masks is None else masks[b].bool()
    return ids, mask
