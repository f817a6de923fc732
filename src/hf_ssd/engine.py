"""The decoding loop: one round = hand the speculation to the draft side -> target verifies -> commit -> next.

The engine does not know how the draft side produces speculations (synchronous drafting, the Saguaro cache,
inline or in a worker); it only sees `start`, `begin` and `resolve`. If the draft side fails, the engine keeps
every committed token and finishes on the exact synchronous path.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .draft import Speculation
from .kv import CachedModel
from .processing import group_by_length, process_block
from .stats import RoundRecord, SSDStats
from .verify import Outcome, draft_slots, verify_greedy, verify_sampled


FAILED = object()  # marks a draft-side call that raised


@dataclass
class RowOutputs:
    tokens: list[list[int]]
    scores: list[list[torch.Tensor]] = field(default_factory=list)
    logits: list[list[torch.Tensor]] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        target: CachedModel,
        drafter,
        processors: LogitsProcessorList,
        stopping: StoppingCriteriaList,
        generation_config: GenerationConfig,
        stats: SSDStats,
        generator: torch.Generator | None = None,
        streamer=None,
        fallback=None,
    ):
        self.target, self.drafter = target, drafter
        self.processors, self.stopping = processors, stopping
        self.greedy = not generation_config.do_sample
        self.want_scores = bool(generation_config.output_scores)
        self.want_logits = bool(generation_config.output_logits)
        self.stats, self.generator, self.streamer = stats, generator, streamer
        self.fallback = fallback  # () -> drafter: builds the exact sync drafter when the draft side fails

    # ---- the loop -----------------------------------------------------------------------------------------------
    def run(self, prompt: torch.Tensor, mask: torch.Tensor) -> RowOutputs:
        B = prompt.shape[0]
        seqs = [prompt[b].cpu() for b in range(B)]
        self.prompt_masks = [mask[b].cpu().bool() for b in range(B)]
        out = RowOutputs([[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)])
        for name in ("per_row_accepted", "per_row_rounds", "per_row_hits", "per_row_lookups"):
            setattr(self.stats, name, [0] * B)
        rows = torch.arange(B)  # original index of each active row
        positions = (mask.long().cumsum(dim=1) - 1).clamp_min(0)
        if prompt.shape[1] > 1:
            self.target.forward(prompt[:, :-1], positions[:, :-1], mask[:, :-1].bool())
        next_pos = positions[:, -1].to(self.target.device)
        spec = self._draft_call(lambda d: d.start(prompt, mask), rows, seqs)
        while rows.numel() > 0:
            swapped = self._draft_call(lambda d: d.begin(spec), rows, seqs, restart=False) is FAILED
            outcome, record, scores, logits = self._verify(spec, [seqs[r] for r in rows.tolist()], next_pos, rows)
            done = self._commit(rows, spec, outcome, seqs, out, scores, logits)
            keep = ~done
            record.rows = rows.numel()
            # Target cache keeps pending + accepted drafts; the rejected tail becomes holes, then is cropped.
            self.target.invalidate(self._block_start + 1 + outcome.accepted.to(self.target.device))
            next_pos = next_pos + 1 + outcome.accepted.to(next_pos.device)
            rows, next_pos = rows[keep], next_pos[keep.to(next_pos.device)]
            self.target.select_rows(keep.nonzero().squeeze(1))
            if rows.numel() > 0:
                contexts = [seqs[r] for r in rows.tolist()]
                if swapped:
                    spec = self.drafter.restart(contexts, [self._row_mask(r, seqs) for r in rows.tolist()])
                else:
                    spec = self._draft_call(lambda d: d.resolve(outcome, keep, contexts), rows, seqs)
                record.resolve_end = self.stats.now()
                span = getattr(self.drafter, "draft_span", None)
                if span is not None:
                    record.draft_start, record.draft_end = span
                self._count_lookups(rows, record)
            self.stats.timeline.append(record)
        self.stats.target_forwards = self.target.forwards
        return out

    def _row_mask(self, r: int, seqs: list[torch.Tensor]) -> torch.Tensor:
        m = self.prompt_masks[r]
        return torch.cat([m, torch.ones(seqs[r].shape[0] - m.shape[0], dtype=torch.bool)])

    # ---- verify -------------------------------------------------------------------------------------------------
    def _verify(self, spec: Speculation, prefixes: list[torch.Tensor], next_pos: torch.Tensor, rows: torch.Tensor):
        record = RoundRecord(verify_start=self.stats.now(), verify_end=0.0)
        K = spec.tokens.shape[1]
        pending = torch.stack([p[-1] for p in prefixes]).to(self.target.device)
        block = torch.cat([pending[:, None], spec.tokens.to(self.target.device)], dim=1)
        positions = next_pos[:, None] + torch.arange(K + 1, device=next_pos.device)
        valid = torch.cat([torch.ones_like(pending[:, None], dtype=torch.bool), draft_slots(spec.n, K).to(block.device)], 1)
        self._block_start = self.target.length
        logits = self.target.forward(block, positions, valid)
        scores = process_block(self.processors, prefixes, spec.tokens.to(logits.device), logits, rows)
        if self.greedy:
            outcome = verify_greedy(spec.tokens.to(scores.device), spec.n.to(scores.device), scores)
        else:
            p = torch.softmax(scores, dim=-1)
            outcome = verify_sampled(spec.tokens.to(p.device), spec.n.to(p.device), p, spec.q.to(p.device), self.generator)
        record.verify_end = self.stats.now()
        self.stats.rounds += 1
        self.stats.drafted += int(spec.n.sum())
        self._last_sources = spec.source.cpu()
        return outcome, record, scores, logits

    # ---- commit -------------------------------------------------------------------------------------------------
    def _commit(self, rows, spec, outcome: Outcome, seqs, out: RowOutputs, scores, logits) -> torch.Tensor:
        """Append accepted drafts + bonus per row, stopping at the first token that meets a stopping criterion."""
        k = outcome.accepted.cpu()
        chunks = [spec.tokens[i, : int(k[i])].cpu().tolist() + [int(outcome.bonus[i])] for i in range(rows.numel())]
        done = torch.zeros(rows.numel(), dtype=torch.bool)
        emitted = [0] * rows.numel()
        for t in range(max(len(c) for c in chunks)):
            live = [i for i in range(rows.numel()) if not done[i] and t < len(chunks[i])]
            if not live:
                break
            for i in live:
                r = int(rows[i])
                seqs[r] = torch.cat([seqs[r], torch.tensor([chunks[i][t]])])
                out.tokens[r].append(chunks[i][t])
                if self.want_scores:
                    out.scores[r].append(scores[i, t].cpu())
                if self.want_logits:
                    out.logits[r].append(logits[i, t].cpu())
                emitted[i] += 1
            for _, group in group_by_length([seqs[int(rows[i])] for i in live]).items():
                idx = [live[g] for g in group]
                ids = torch.stack([seqs[int(rows[i])] for i in idx])
                step_scores = scores[torch.tensor(idx), t].cpu()
                stop = self.stopping(ids, step_scores).cpu()
                for j, i in enumerate(idx):
                    done[i] = bool(stop[j])
        for i in range(rows.numel()):
            r = int(rows[i])
            acc = min(int(k[i]), emitted[i])
            self.stats.accepted += acc
            self.stats.emitted += emitted[i]
            self.stats.accept_hist[int(k[i])] += 1
            self.stats.per_row_accepted[r] += acc
            self.stats.per_row_rounds[r] += 1
        if self.streamer is not None:
            self.streamer.put(torch.tensor(out.tokens[int(rows[0])][-emitted[0]:]))
        return done

    def _count_lookups(self, rows: torch.Tensor, record: RoundRecord) -> None:
        hits = getattr(self.drafter, "last_hits", None)
        if hits is None:
            return
        for i, r in enumerate(rows.tolist()):
            self.stats.per_row_lookups[r] += 1
            self.stats.per_row_hits[r] += int(hits[i])
        record.hits, record.lookups = int(hits.sum()), int(hits.numel())
        backup = getattr(self.drafter, "last_backup", None)
        record.backup = backup

    # ---- failures of the draft side -----------------------------------------------------------------------------
    def _draft_call(self, call, rows: torch.Tensor, seqs: list[torch.Tensor], restart: bool = True):
        """Run a draft-side call. If it raises, warn, switch to the next exact fallback drafter (Saguaro -> sync ->
        none) and, unless told not to, restart it on the committed tokens. Committed tokens live in `seqs`, so a
        failure never loses any."""
        while True:
            try:
                return call(self.drafter)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as exc:  # the draft side is advisory: no failure there may cost target tokens
                if self.fallback is None:
                    raise
                self._switch(exc)
                if not restart:
                    return FAILED
                active = rows.tolist()
                row_seqs, row_masks = [seqs[r] for r in active], [self._row_mask(r, seqs) for r in active]
                call = lambda d: d.restart(row_seqs, row_masks)  # noqa: E731

    def _switch(self, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"hf_ssd: the draft side ({getattr(self.drafter, 'kind', '?')}) failed ({reason}); continuing on the "
            "exact fallback path. Generated tokens are kept and the output distribution is unchanged.",
            RuntimeWarning,
            stacklevel=3,
        )
        self.stats.fallback_reason = reason
        try:
            self.drafter.close()
        except Exception:
            pass
        self.drafter = self.fallback(self.drafter)
