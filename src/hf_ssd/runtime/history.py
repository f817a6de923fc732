"""Committed tokens of every row of a generation: one growing buffer, rows addressed as views (no per-token cat)."""
from __future__ import annotations

import torch


class History:
    def __init__(self, prompt: torch.Tensor, mask: torch.Tensor):
        B, P = prompt.shape
        self.buffer = torch.zeros(B, max(2 * P, 16), dtype=torch.long)
        self.buffer[:, :P] = prompt.cpu()
        self.lengths = [P] * B
        self.prompt_masks = [mask[b].cpu().bool() for b in range(B)]

    def row(self, r: int) -> torch.Tensor:
        """Row r's committed tokens, prompt (with its left padding) first: a 1D view."""
        return self.buffer[r, : self.lengths[r]]

    def rows(self, indices: list[int]) -> list[torch.Tensor]:
        return [self.row(r) for r in indices]

    def append(self, r: int, token: int) -> None:
        if self.lengths[r] == self.buffer.shape[1]:
            grown = torch.zeros(self.buffer.shape[0], 2 * self.buffer.shape[1], dtype=torch.long)
            grown[:, : self.buffer.shape[1]] = self.buffer
            self.buffer = grown
        self.buffer[r, self.lengths[r]] = token
        self.lengths[r] += 1
