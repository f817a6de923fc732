"""Saguaro's draft side on the static cache (`runtime.static_kv`): fixed shapes and no host reads from the start of
a round's tree to its lookup, so the glue and the K tree steps can run as compiled graphs (CUDA graphs on GPU).

Differences from `SaguaroDrafter`, none of which changes what is drafted:
- the glue is written at each row's write pointer; tree step s of branch i at slot tree0 + (s-1)*N + i, and each
  step's mask is a `SlotAttend` (lim = glue start + depth, branch = i) instead of a concatenated [B, N, L] matrix;
- every tree step has exactly N = `tree_width` branches per row (`fork(width=N, f_max=...)`; unchosen slots are
  invalid branches), so the glue has one shape (K+1) and every tree step another (N);
- fan-outs come from the host copy of the schedule, so sigma_{F,C} needs no host read; the NaN/inf check of the
  tree's q is a device flag read in `resolve`, after the lookup (a bad q is still never handed over);
- after the round a row's pointer moves back to the end of its accepted tokens (tree and rejected slots are
  overwritten next round); finished rows stay as dead rows of the fixed batch.
"""
from __future__ import annotations

import torch

from hf_ssd.config import SSDConfig
from hf_ssd.core.sampling import BAD_PROBS, sample, saguaro_probs
from hf_ssd.core.tree import fork, tree_width
from hf_ssd.core.types import DraftResult, Speculation, Verdict
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.saguaro import SaguaroDrafter, SpeculationCache
from hf_ssd.runtime.static_kv import SlotAttend
from hf_ssd.runtime.stats import SSDStats


class StaticSaguaroDrafter(SaguaroDrafter):
    def __init__(self, draft: DraftModel, config: SSDConfig, stats: SSDStats, budget: int, greedy: bool):
        super().__init__(draft, config, stats, budget, greedy)
        kv = draft.kv
        self.N = tree_width(config, self.K, budget, draft.vocab_size)
        device = kv.device
        self.glue_ids = torch.arange(self.K + 1, device=device)
        self.branch_ids = torch.arange(self.N, device=device)
        self._bad = None  # [] bool on the device: some tree q had NaN, inf or a negative entry
        stats.draft_static = True

    def _plan(self) -> None:
        super()._plan()
        self.hit_host = list(self.stats.fanout_after_hit)  # host copies: no device read to size the math
        self.f_max = max(self.hit_host + list(self.stats.fanout_after_miss))

    # ---- the hot path: no host reads from here to the lookup ------------------------------------------------------
    def _propose_no_sync(self, scores: torch.Tensor, fanout: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`DraftModel.propose` with the fan-out F as a host int (one for the whole tree step): same q, same draws."""
        if self.greedy:
            return scores.argmax(dim=-1), None
        q = saguaro_probs(scores, fanout, self.draft.downweight)
        low, high = torch.aminmax(q)
        bad = ~((low >= 0) & (high < float("inf")))
        self._bad = bad if self._bad is None else self._bad | bad
        return sample(q, self.draft.generator, check=False), q

    def begin_no_sync(self, spec: Speculation) -> None:
        """The glue forward and K fixed-shape tree steps; every shape and loop bound is known on the host."""
        kv, K, N = self.draft.kv, self.K, self.N
        self.spec = spec
        tokens, n = spec.tokens.to(kv.device), spec.n.to(kv.device)
        B = tokens.shape[0]
        fanout = self._fanout(spec.source.to(kv.device))
        glue = kv.write_pointer()  # [B] slot of t_prev in each row
        self.glue_start = glue
        start = kv.next_position()
        glue_valid = torch.cat([torch.ones_like(n[:, None], dtype=torch.bool),
                                self.glue_ids[None, :K] < n[:, None]], dim=1)
        positions = start[:, None] + self.glue_ids
        block = torch.cat([self.t_prev[:, None], tokens], dim=1)
        self.glue_scores = self.draft.scores(kv.forward(block, positions, glue_valid))
        forks = fork(self.glue_scores, tokens, n, fanout, width=N, f_max=self.f_max)
        attend = SlotAttend(glue[:, None] + forks.depth, self.branch_ids[None].expand(B, N), glue + K + 1)
        branch_tokens, branch_q = [], []
        current = forks.tokens
        for step in range(1, K + 1):
            pos = start[:, None] + forks.depth + step
            logits = kv.forward(current, pos, forks.valid, attend)
            current, q = self._propose_no_sync(self.draft.scores(logits), self.hit_host[step - 1])
            branch_tokens.append(current)
            branch_q.append(q)
        q_all = None if self.greedy else torch.stack(branch_q, dim=2)
        self.cache = SpeculationCache(forks, torch.stack(branch_tokens, dim=2), q_all)

    def begin(self, spec: Speculation) -> None:
        t0 = self.stats.now()
        self._bad = None
        self.begin_no_sync(spec)
        self.draft_span = (t0, self.stats.now())
        self.backup.t_tree.add(self.draft_span[1] - t0)
        self.stats.draft_compile_s = round(self.draft.kv.compile_s, 4)
        self.stats.draft_compiled = self.draft.kv.compiled_calls > 0

    # ---- off the hot path ---------------------------------------------------------------------------------------
    def resolve(self, verdict: Verdict) -> DraftResult:
        if self._bad is not None and bool(self._bad):  # a NaN must never become a token (see check_probs)
            raise RuntimeError(BAD_PROBS)
        return super().resolve(verdict)

    def _jit(self, rows_valid: torch.Tensor) -> Speculation:
        """Neural backup (its single steps run compiled), then every row's pointer goes back to where it was."""
        kv = self.draft.kv
        before = kv.write_pointer()
        fanout = self.after_miss[: self.K][None].expand(rows_valid.shape[0], self.K)
        pending = self.t_prev[:, None]
        spec = self.draft.jit(pending, torch.ones_like(pending, dtype=torch.bool), self.K, fanout, rows_valid)
        kv.invalidate(before)
        kv.trim()
        return spec

    def close(self) -> None:
        super().close()
        self.draft.kv.release()
