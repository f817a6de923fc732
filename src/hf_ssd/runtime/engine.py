"""The decoding loop: one round = hand the speculation to the draft side -> target verifies -> commit -> next.

The engine does not know how the draft side produces speculations (synchronous drafting, the Saguaro cache,
inline or in a worker): it calls the drafter protocol (hf_ssd.draft.protocol) and reads what `resolve` returns.
Failures of the draft side are handled below it (hf_ssd.draft.fallback), so the engine never loses a token.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from hf_ssd.core.device_span import DeviceSpan
from hf_ssd.core.types import DraftResult, Outcome, Speculation, Verdict
from hf_ssd.core.verify import draft_slots, verify_greedy, verify_sampled
from hf_ssd.runtime.history import History
from hf_ssd.runtime.kv import CachedModel
from hf_ssd.runtime.prefill import prefill_prompt
from hf_ssd.runtime.processing import group_by_length, process_block
from hf_ssd.runtime.stats import RoundRecord, SSDStats

if TYPE_CHECKING:
    from hf_ssd.draft.protocol import Drafter


@dataclass
class RowOutputs:
    tokens: list[list[int]]
    scores: list[list[torch.Tensor]] = field(default_factory=list)
    logits: list[list[torch.Tensor]] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        target: CachedModel,
        drafter: Drafter,
        processors: LogitsProcessorList,
        stopping: StoppingCriteriaList,
        generation_config: GenerationConfig,
        stats: SSDStats,
        generator: torch.Generator | None = None,
        streamer=None,
    ):
        self.target, self.drafter = target, drafter
        self.processors, self.stopping = processors, stopping
        self.greedy = not generation_config.do_sample
        self.want_scores = bool(generation_config.output_scores)
        self.want_logits = bool(generation_config.output_logits)
        self.stats, self.generator, self.streamer = stats, generator, streamer
        self.cache_warned = False

    # ---- the loop -----------------------------------------------------------------------------------------------
    def run(self, prompt: torch.Tensor, mask: torch.Tensor) -> RowOutputs:
        B = prompt.shape[0]
        self.history = History(prompt, mask)
        out = RowOutputs([[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)])
        for name in ("per_row_accepted", "per_row_rounds", "per_row_hits", "per_row_lookups"):
            setattr(self.stats, name, [0] * B)
        rows = torch.arange(B)  # original index of each active row
        positions = (mask.long().cumsum(dim=1) - 1).clamp_min(0)
        overlapped = self.drafter.prepare(prompt, mask)  # a draft process prefills while the target does
        prefill_span = DeviceSpan(self.target.device)
        prefill_prompt(self.target, prompt, mask)
        if not overlapped and prompt.shape[1] > 1:  # what it costs alone: the controller prices a call's start by it
            self.stats.target_prefill_s = prefill_span.stop().seconds()
        next_pos = positions[:, -1].to(self.target.device)
        spec = self.drafter.start(prompt, mask)
        while rows.numel() > 0:
            # 1. The draft side learns what is being verified (a concurrent worker starts its tree now).
            self.drafter.begin(spec)
            # 2. The target verifies the speculation; 3. accepted drafts + bonus are committed.
            active = rows.tolist()
            outcome, record, scores, logits, span = self._verify(spec, self.history.rows(active), next_pos, rows)
            done = self._commit(active, spec, outcome, out, scores, logits)
            if span.cuda:  # the verify's work, not its launches (the commit's host reads waited for it)
                record.verify_end = record.verify_start + span.seconds()
            keep = ~done
            record.rows = len(active)
            # 4. The target cache keeps pending + accepted drafts; the rejected tail becomes holes, then is cropped.
            self.target.invalidate(self._block_start + 1 + outcome.accepted.to(self.target.device))
            next_pos = next_pos + 1 + outcome.accepted.to(next_pos.device)
            rows, next_pos = rows[keep], next_pos[keep.to(next_pos.device)]
            self.target.select_rows(keep.nonzero().squeeze(1))
            # 5. The draft side turns the outcome into the next speculation (cache hit, or a backup).
            if rows.numel() > 0:
                kept = rows.tolist()
                verdict = Verdict(outcome, keep, self.history.rows(kept),
                                  [self.history.prompt_masks[r] for r in kept], record.verify_end - record.verify_start)
                record.resolve_start = self.stats.now()
                result = self.drafter.resolve(verdict)
                spec = result.spec
                record.resolve_end = self.stats.now()
                self._record_draft(kept, result, record)
            self.stats.timeline.append(record)
        self.stats.target_forwards = self.target.forwards
        return out

    # ---- verify -------------------------------------------------------------------------------------------------
    def _verify(self, spec: Speculation, prefixes: list[torch.Tensor], next_pos: torch.Tensor, rows: torch.Tensor):
        record = RoundRecord(verify_start=self.stats.now(), verify_end=0.0)
        span = DeviceSpan(self.target.device)
        K = spec.tokens.shape[1]
        pending = torch.stack([p[-1] for p in prefixes]).to(self.target.device)
        block = torch.cat([pending[:, None], spec.tokens.to(self.target.device)], dim=1)
        positions = next_pos[:, None] + torch.arange(K + 1, device=next_pos.device)
        valid = torch.cat([torch.ones_like(pending[:, None], dtype=torch.bool), draft_slots(spec.n, K).to(block.device)], 1)
        self._block_start = self.target.write_pointer()  # per row: a static cache's rows advance apart
        logits = self.target.forward(block, positions, valid)
        scores = process_block(self.processors, prefixes, spec.tokens.to(logits.device), logits, rows)
        if self.greedy:
            outcome = verify_greedy(spec.tokens.to(scores.device), spec.n.to(scores.device), scores)
        else:
            p = torch.softmax(scores, dim=-1)
            # a speculation with no drafts at all (plain target steps) carries no q; its slots are never accepted
            q = spec.q.to(p.device) if spec.q is not None else p.new_zeros(p.shape[0], K, p.shape[-1])
            outcome = verify_sampled(spec.tokens.to(p.device), spec.n.to(p.device), p, q, self.generator)
        span.stop()
        record.verify_end = self.stats.now()
        self.stats.rounds += 1
        self.stats.drafted += int(spec.n.sum())
        return outcome, record, scores, logits, span

    # ---- commit -------------------------------------------------------------------------------------------------
    def _commit(self, active: list[int], spec: Speculation, outcome: Outcome, out: RowOutputs, scores, logits):
        """Append accepted drafts + bonus per row, stopping at the first token that meets a stopping criterion.
        Returns [B] bool: rows that finished."""
        B = len(active)
        k, bonus, drafts = outcome.accepted.tolist(), outcome.bonus.tolist(), spec.tokens.tolist()
        n = spec.n.tolist()
        chunks = [drafts[i][: k[i]] + [bonus[i]] for i in range(B)]
        done = [False] * B
        emitted = [0] * B
        for t in range(max(len(c) for c in chunks)):
            live = [i for i in range(B) if not done[i] and t < len(chunks[i])]
            if not live:
                break
            for i in live:
                r = active[i]
                self.history.append(r, chunks[i][t])
                out.tokens[r].append(chunks[i][t])
                if self.want_scores:
                    out.scores[r].append(scores[i, t].cpu())
                if self.want_logits:
                    out.logits[r].append(logits[i, t].cpu())
                emitted[i] += 1
            rows_now = self.history.rows([active[i] for i in live])
            for _, group in group_by_length(rows_now).items():
                idx = [live[g] for g in group]
                ids = torch.stack([rows_now[g] for g in group])
                stop = self.stopping(ids, scores[torch.tensor(idx), t].cpu()).tolist()
                for j, i in enumerate(idx):
                    done[i] = bool(stop[j])
        for i, r in enumerate(active):
            acc = min(k[i], emitted[i])
            self.stats.accepted += acc
            self.stats.emitted += emitted[i]
            self.stats.accept_hist[k[i]] += 1
            self.stats.rejected += int(k[i] < n[i])
            self.stats.per_row_accepted[r] += acc
            self.stats.per_row_rounds[r] += 1
        if self.streamer is not None:
            self.streamer.put(torch.tensor(out.tokens[active[0]][-emitted[0]:]))
        return torch.tensor(done, dtype=torch.bool)

    def _record_draft(self, kept: list[int], result: DraftResult, record: RoundRecord) -> None:
        if result.draft_span is not None:
            record.draft_start, record.draft_end = result.draft_span
        record.handover_s = result.handover_s
        if result.hits is None:
            return
        hits = result.hits.tolist()
        for r, h in zip(kept, hits):
            self.stats.per_row_lookups[r] += 1
            self.stats.per_row_hits[r] += int(h)
        record.hits, record.lookups, record.backup = sum(hits), len(hits), result.backup
        self._watch_cache()

    def _watch_cache(self) -> None:
        """Say once when the speculation cache is effectively off: SSD then only adds work to synchronous SD."""
        if self.cache_warned:
            return
        s = self.stats
        reason = None
        if s.budget is not None and s.budget < 2:
            reason = f"its budget is {s.budget} branch per row"
        elif s.cache_lookups >= 20 * max(1, len(s.per_row_lookups)) and (s.hit_rate or 0.0) < 0.10:
            reason = f"{s.cache_hits} of {s.cache_lookups} lookups hit ({s.hit_rate:.0%})"
        if reason is not None:
            self.cache_warned = True
            warnings.warn(f"hf_ssd: the speculation cache is effectively disabled ({reason}); SSD cannot beat "
                          "synchronous SD like this. Raise ssd_budget, or leave ssd_mode unset so the controller "
                          "picks the faster exact mode.", RuntimeWarning, stacklevel=2)
