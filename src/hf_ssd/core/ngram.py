"""Prompt-lookup backup: propose the tokens that followed the latest earlier occurrence of the context's tail.

Its proposals are deterministic, so they are verified as point masses (docs/algorithm.md §1), never by greedy
matching at T > 0.
"""
from __future__ import annotations

import torch


def ngram_propose(context: torch.Tensor, K: int, max_ngram: int = 3) -> list[int]:
    """Up to K tokens continuing `context` (1D) by its longest repeated suffix n-gram (n <= max_ngram)."""
    ctx = context.tolist()
    L = len(ctx)
    for n in range(min(max_ngram, L - 1), 0, -1):
        tail = ctx[L - n:]
        # Latest earlier match wins: recent text predicts the continuation best.
        for start in range(L - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                follow = ctx[start + n:start + n + K]
                if follow:
                    return follow
    return []


def ngram_batch(contexts: list[torch.Tensor], K: int, max_ngram: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K] proposals (padded with `fill`) and [B] how many are real (0 where nothing matches: plain decoding)."""
    tokens = torch.full((len(contexts), K), fill, dtype=torch.long)
    counts = torch.zeros(len(contexts), dtype=torch.long)
    for b, ctx in enumerate(contexts):
        prop = ngram_propose(ctx, K, max_ngram)
        if prop:
            tokens[b, :len(prop)] = torch.tensor(prop)
            counts[b] = len(prop)
    return tokens, counts
