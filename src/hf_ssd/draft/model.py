"""The draft model as a proposer: its cache, how its logits become proposals, and just-in-time drafting.

Only input-independent warpers (temperature, top-k/p, ...) shape the draft: q may be any distribution as long as
the verifier sees exactly the q the drafts were drawn from, and warpers make q close to the target's p.
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from hf_ssd.core.types import SOURCE_JIT, Speculation
from hf_ssd.runtime.kv import CachedModel
from hf_ssd.runtime.prefill import prefill_prompt
from hf_ssd.runtime.processing import INPUT_INDEPENDENT
from hf_ssd.core.sampling import sample, saguaro_probs

class DraftModel:
    def __init__(
        self,
        model: PreTrainedModel,
        batch_size: int,
        vocab_size: int,
        processors: LogitsProcessorList,
        greedy: bool,
        downweight: float,
        generator: torch.Generator | None,
        kv=None,
        packed_linear: bool | str = "auto",
    ):
        # kv: the cache to use (default: a CachedModel); runtime.static_kv.StaticCachedModel for the static path
        self.kv = CachedModel(model, batch_size, packed_linear) if kv is None else kv
        self.vocab_size = vocab_size
        self.warpers = LogitsProcessorList([p for p in processors if isinstance(p, INPUT_INDEPENDENT)])
        self.greedy = greedy
        self.downweight = downweight
        self.generator = generator

    # ---- logits -> proposals -----------------------------------------------------------------------------------
    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits in the target's vocabulary, warped: [..., V]."""
        V = self.vocab_size
        if logits.shape[-1] > V:  # padded embedding rows beyond the shared vocabulary are never proposed
            logits = logits[..., :V]
        elif logits.shape[-1] < V:
            pad = logits.new_full((*logits.shape[:-1], V - logits.shape[-1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)
        if len(self.warpers) == 0 or self.greedy:
            return logits
        flat = logits.reshape(-1, V)
        dummy = torch.zeros(flat.shape[0], 1, dtype=torch.long, device=flat.device)
        return self.warpers(dummy, flat).reshape(logits.shape)

    def propose(self, scores: torch.Tensor, fanout: torch.Tensor | int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row of [..., V] scores, and the q it was drawn from (Saguaro sigma_{F,C})."""
        if self.greedy:
            return scores.argmax(dim=-1), None
        q = saguaro_probs(scores, fanout, self.downweight)
        return sample(q, self.generator), q

    # ---- cache --------------------------------------------------------------------------------------------------
    def prefill(self, prompt: torch.Tensor, mask: torch.Tensor) -> None:
        """Feed all prompt tokens but the last (the last is fed with the first drafts)."""
        prefill_prompt(self.kv, prompt, mask)

    def jit(
        self,
        pending: torch.Tensor,
        pending_valid: torch.Tensor,
        K: int,
        fanout: torch.Tensor | None = None,
        rows_valid: torch.Tensor | None = None,
    ) -> Speculation:
        """Draft K tokens autoregressively after the right-aligned `pending` tokens [B, m].

        fanout: [B, K] F per draft position for Saguaro sampling (None: plain). rows_valid: rows that need drafts
        (the others ride along as holes). Leaves pending and d_1..d_{K-1} in the cache.
        """
        B = pending.shape[0]
        device = self.kv.device
        if rows_valid is None:
            rows_valid = torch.ones(B, dtype=torch.bool, device=device)
        rows_valid = rows_valid.to(device)
        if fanout is None:
            fanout = torch.zeros(B, K, dtype=torch.long, device=device)
        pending_valid = pending_valid.to(device) & rows_valid[:, None]
        start = self.kv.next_position()
        positions = start[:, None] + pending_valid.long().cumsum(dim=1) - 1
        logits = self.kv.forward(pending, positions.clamp_min(0), pending_valid)[:, -1]
        next_pos = positions[:, -1] + 1
        tokens, qs, scores = [], [], []
        for i in range(K):
            scores.append(self.scores(logits))
            token, q = self.propose(scores[-1], fanout[:, i])
            tokens.append(token)
            qs.append(q)
            if i + 1 < K:
                logits = self.kv.forward(token[:, None], next_pos[:, None] + i, rows_valid[:, None])[:, -1]
        self.jit_scores = scores  # [B, V] at draft positions 0..K-1: what a next glue forward would compute again
        tokens_t = torch.stack(tokens, dim=1)
        q_t = None if self.greedy else torch.stack(qs, dim=1)
        n = torch.full((B,), K, dtype=torch.long, device=device)
        return Speculation(tokens_t, n, q_t, torch.full((B,), SOURCE_JIT, dtype=torch.long, device=device))
