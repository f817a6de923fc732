"""Saguaro's draft side: while the target verifies a speculation, pre-draft the next one for likely outcomes.

Invariant between rounds: the draft cache holds every committed token before `t_prev` (the last bonus token).
`begin` runs the glue forward over [t_prev, d_1..d_K], forks the top-F_j bonus guesses per position, and grows
every branch K tokens in K batched tree steps: the speculation cache. `resolve` looks the real outcome (k, t*)
up per row: a hit hands over that branch's K tokens and their exact q; a miss goes to the backup.
"""
from __future__ import annotations

import torch

from hf_ssd.core.backup import BackupPolicy
from hf_ssd.core.device_span import DeviceSpan
from hf_ssd.config import SSDConfig
from hf_ssd.core.types import SOURCE_CACHE, SOURCE_NAMES, SOURCE_NGRAM, DraftResult, Forks, Outcome, Speculation, Verdict
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.protocol import Drafter
from hf_ssd.core.fanout import PRIOR_ALPHA, RANK_FMAX, FanoutPlanner
from hf_ssd.core.ngram import ngram_batch
from hf_ssd.core.sampling import point_mass
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.core.tree import fork, tree_attend



def drafted_by_model(source: torch.Tensor) -> torch.Tensor:
    """[B] bool: the speculation came from the draft model (cache hit or JIT), not the n-gram backup."""
    return source != SOURCE_NGRAM

class SpeculationCache:
    """(row, k, t*) -> the drafted tokens of that branch and the distributions they were drawn from."""

    def __init__(self, forks: Forks, tokens: torch.Tensor, q: torch.Tensor | None, n: torch.Tensor | None = None):
        self.forks, self.tokens, self.q = forks, tokens, q  # tokens [B, N, K], q [B, N, K, V]
        self.n = n  # [B, N] drafts per branch (None: K for every branch)

    def lookup(self, outcome: Outcome) -> tuple[torch.Tensor, torch.Tensor]:
        """(hit [B] bool, branch index [B]) for every row at once."""
        f = self.forks
        k, bonus = outcome.accepted.to(f.tokens.device), outcome.bonus.to(f.tokens.device)
        match = f.valid & (f.depth == k[:, None]) & (f.tokens == bonus[:, None])
        return match.any(dim=1), match.long().argmax(dim=1)


class SaguaroDrafter(Drafter):
    kind = "ssd"

    def __init__(self, draft: DraftModel, config: SSDConfig, stats: SSDStats, budget: int, greedy: bool):
        self.draft, self.config, self.stats, self.greedy = draft, config, stats, greedy
        self.K = config.num_draft_tokens
        # No tree holds more distinct outcomes (k, t*) than this: V-1 bonus guesses after each of k < K accepted
        # drafts (a rejected draft is never the bonus), V after all K; a larger budget would only cost time.
        budget = max(1, min(budget, (self.K + 1) * (draft.vocab_size - 1) + 1))
        after_hit = PRIOR_ALPHA[0] if config.alpha_prior is None else config.alpha_prior
        self.planner = FanoutPlanner(
            budget, self.K, alpha=config.alpha, r=config.power_r, fanout=config.fanout,
            fanout_after_miss=config.fanout_after_miss, prior_alpha=(after_hit, PRIOR_ALPHA[1]),
        )
        self.backup = BackupPolicy(config)
        self.cache: SpeculationCache | None = None
        self.draft_span = None
        self.tree_span: DeviceSpan | None = None  # the last tree's device time, read once its lookup has synced
        self.jit_span: DeviceSpan | None = None  # the last neural backup's, read a round later
        self._unlearned: tuple | None = None  # the last resolved round, until settle() learns from it
        self._plan()
        stats.budget = budget

    @property
    def forwards(self) -> int:
        return self.draft.kv.forwards

    # ---- schedules ----------------------------------------------------------------------------------------------
    def _plan(self) -> None:
        """Both fan-out schedules for the coming round, computed once (they change only when the estimates do)."""
        hit, miss = self.planner.schedule(True), self.planner.schedule(False)
        self.stats.fanout_after_hit, self.stats.fanout_after_miss = hit, miss
        device = self.draft.kv.device
        self.after_hit = torch.tensor(hit, device=device)
        self.after_miss = torch.tensor(miss, device=device)

    def _fanout(self, source: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """[B, K+1] fan-out per row: the after-hit schedule for speculations the draft model wrote (from the cache,
        or just in time: the first round's, a JIT backup's), the after-miss one for the n-gram backup's, which
        accept differently. A speculation of n < K drafts has no outcomes past position n: position n (all
        accepted) gets the guesses of positions n..K, F_n + ... + F_K, so the all-accepted guesses (F_K) are not
        lost and the tree keeps its width."""
        fan = torch.where(drafted_by_model(source)[:, None], self.after_hit[None], self.after_miss[None])
        tail = fan.flip(1).cumsum(dim=1).flip(1)  # tail[:, j] = F_j + ... + F_K
        return fan.scatter(1, n[:, None], tail.gather(1, n[:, None]))

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        self.draft.prefill(prompt, mask)
        self.t_prev = prompt[:, -1].to(self.draft.kv.device)
        return self._jit(torch.ones_like(self.t_prev, dtype=torch.bool))

    def begin(self, spec: Speculation) -> None:
        """Build the speculation cache for the outcomes of `spec` (the speculation now being verified)."""
        self.settle()
        t0 = self.stats.now()
        kv, K = self.draft.kv, self.K
        self.tree_span = DeviceSpan(kv.device)
        self.spec = spec
        tokens, n = spec.tokens.to(kv.device), spec.n.to(kv.device)
        fanout = self._fanout(spec.source.to(kv.device), n)
        self.glue_start = kv.length
        start = kv.next_position()
        past_valid = kv.valid.clone()
        glue_valid = torch.cat([torch.ones_like(n[:, None], dtype=torch.bool),
                                torch.arange(K, device=kv.device)[None] < n[:, None]], dim=1)
        positions = start[:, None] + torch.arange(K + 1, device=kv.device)
        block = torch.cat([self.t_prev[:, None], tokens], dim=1)
        self.glue_scores = self.draft.scores(kv.forward(block, positions, glue_valid))
        forks = fork(self.glue_scores, tokens, n, fanout)
        # Branch tokens are drawn with sigma_{F,C} for the fan-out their own verification round will use.
        branch_tokens, branch_q = [], []
        current = forks.tokens
        for step in range(1, K + 1):
            attend = tree_attend(past_valid, glue_valid, forks, step)
            pos = start[:, None] + forks.depth + step
            logits = kv.forward(current, pos, forks.valid, attend)
            current, q = self.draft.propose(self.draft.scores(logits), self.after_hit[step - 1])
            branch_tokens.append(current)
            branch_q.append(q)
        q_all = None if self.greedy else torch.stack(branch_q, dim=2)
        self.cache = SpeculationCache(forks, torch.stack(branch_tokens, dim=2), q_all)
        self.tree_span.stop()
        self.draft_span = (t0, self.stats.now())

    def resolve(self, verdict: Verdict) -> DraftResult:
        kv, outcome = self.draft.kv, verdict.outcome
        k, bonus = outcome.accepted.to(kv.device), outcome.bonus.to(kv.device)
        hit, branch = self.cache.lookup(outcome)
        self._learn_backup(outcome, hit, self.spec, verdict.verify_s)  # a host read: the tree is done
        tree_s = self._tree_timed()
        if self.jit_span is not None:  # the last neural backup's device time: its drafts were verified since
            self.backup.t_jit.add(self.jit_span.seconds())
            self.jit_span = None
        # the rest is learned in settle(), once the next speculation is handed over (the process worker's child
        # settles right after its answer; otherwise the next begin does): ~0.3 ms a round off the critical path
        self._unlearned = (outcome, self.spec, self.glue_scores)
        # Keep t_prev and the accepted drafts; rejected drafts and every tree branch become holes.
        kv.invalidate(self.glue_start + 1 + k)
        rows = verdict.keep.to(kv.device).nonzero().squeeze(1)
        kv.select_rows(rows)
        self.t_prev = bonus[rows]
        hit, branch = hit[rows], branch[rows]
        B = rows.numel()
        c = self.cache
        hit_rows = hit.nonzero().squeeze(1)
        src_rows = rows[hit_rows]
        from_cache = Speculation(
            c.tokens[src_rows, branch[hit_rows]],
            torch.full((hit_rows.numel(),), self.K, dtype=torch.long, device=kv.device) if c.n is None
            else c.n[src_rows, branch[hit_rows]],
            None if c.q is None else c.q[src_rows, branch[hit_rows]],
            torch.full((hit_rows.numel(),), SOURCE_CACHE, dtype=torch.long, device=kv.device),
        )
        parts = [(hit_rows, from_cache)]
        miss_rows = (~hit).nonzero().squeeze(1)
        n_miss = miss_rows.numel()
        self.stats.cache_lookups += B
        self.stats.cache_hits += B - n_miss
        backup = self.backup.choose(B) if n_miss else None
        self._carry_over(hit, src_rows, branch[hit_rows], from_cache.n, backup)
        self.cache = None
        if n_miss:
            self.stats.backup_rounds[backup] += 1
            t0 = self.stats.now()
            if backup == "jit":
                span = DeviceSpan(kv.device)
                spec = self._jit(~hit)
                parts.append((miss_rows, Speculation(spec.tokens[miss_rows], spec.n[miss_rows],
                                                     None if spec.q is None else spec.q[miss_rows],
                                                     spec.source[miss_rows])))
                self.jit_span = span.stop()  # read at the next resolve, once its drafts were verified
            else:
                contexts = [verdict.contexts[i] for i in miss_rows.tolist()]
                parts.append((miss_rows, self._ngram(contexts)))
                self.backup.t_fast.add(self.stats.now() - t0)
        self.stats.backup_threshold = self.backup.threshold() if self.backup.forced is None else None
        return DraftResult(Speculation.merge(parts, B), hits=hit.cpu(), backup=backup, draft_span=self.draft_span,
                           draft_s=tree_s)

    def _tree_timed(self) -> float | None:
        """The looked-up tree's device seconds, fed to the backup policy (before it chooses this round's backup)."""
        if self.tree_span is None:
            return None
        tree_s, self.tree_span = self.tree_span.seconds(), None
        self.backup.t_tree.add(tree_s)
        return tree_s

    def close(self) -> None:
        try:
            self.settle()  # the last round's outcome still counts in the stats
        except Exception:  # noqa: BLE001 - a drafter that failed may fail to learn too; its stats are not the output
            pass
        self.cache = None

    def _carry_over(self, hit: torch.Tensor, src_rows: torch.Tensor, branch: torch.Tensor, n: torch.Tensor,
                    backup: str | None) -> None:
        """Called once the lookup is done, before any backup runs: the rows that hit (hit [B'] over the kept rows)
        take branch `branch` of tree row `src_rows` with `n` drafts. Here the tree is simply dropped (the next glue
        forward recomputes those tokens); the static drafter keeps their KV and scores instead."""

    # ---- learning from outcomes ---------------------------------------------------------------------------------
    def settle(self) -> None:
        """Learn from the last resolved round, if not done yet. Deferred from resolve so the next speculation goes
        out first; the lookup's result does not depend on it, only the next tree's fan-out and the backup policy's
        estimates (one round later than the outcome, whatever the worker: the same plans inline and in a process)."""
        unlearned, self._unlearned = self._unlearned, None
        if unlearned is not None:
            self._learn(*unlearned)

    def _learn_backup(self, outcome: Outcome, hit: torch.Tensor, spec: Speculation, verify_s: float) -> None:
        """What the backup policy weighs, from this round, before it chooses this round's backup: the verify's time,
        the hit, and the tokens a speculation of each source committed (learned one round late, the policy chose
        the n-gram backup more often: 4.57 tokens a round against 4.92 at α = 1). One host read."""
        self.backup.t_verify.add(verify_s)
        device = hit.device
        table = torch.stack([outcome.accepted.to(device), spec.source.to(device), hit.long()], dim=1).tolist()
        for kb, source, hit_b in table:
            self.backup.tokens[SOURCE_NAMES[source]].add(kb + 1)
            self.backup.p_hit.add(float(hit_b))

    def _learn(self, outcome: Outcome, spec: Speculation, scores: torch.Tensor) -> None:
        """Feed a round's outcomes (of `spec`, drafted from the glue `scores`) to the fan-out estimators (the
        bonus's rank among the draft's guesses, the accepted length), then re-plan. One host read."""
        device = scores.device
        k, bonus = outcome.accepted.to(device), outcome.bonus.to(device)
        rows = torch.arange(k.shape[0], device=device)
        row_scores = scores[rows, k]  # [B, V] glue scores at the accepted length
        better = row_scores > row_scores.gather(1, bonus[:, None])
        # the rejected draft d_{k+1} was not among the guesses, so it does not count against the bonus's rank
        n = spec.n.to(device)
        rejected = spec.tokens.to(device).gather(1, k.clamp_max(self.K - 1)[:, None]).squeeze(1)
        rejected_better = better.gather(1, rejected[:, None]).squeeze(1) & (k < n)
        rank = better.sum(dim=1) - rejected_better.long()
        table = torch.stack([k, n, rank, spec.source.to(device)], dim=1).tolist()
        for kb, n_b, rank_b, source in table:
            self.planner.observe(source != SOURCE_NGRAM, kb, n_b, bonus_rank=rank_b)
            if source != SOURCE_NGRAM:
                self.stats.bonus_ranks[min(rank_b, RANK_FMAX)] += 1
        self.stats.alpha = round(self.planner.hit.alpha.value, 4)
        self.stats.power_r = round(self.planner.hit.miss.fit()[0], 4)
        self._plan()

    # ---- backups ------------------------------------------------------------------------------------------------
    def _jit(self, rows_valid: torch.Tensor) -> Speculation:
        """Neural backup: K draft steps after t_prev for `rows_valid`, then restore the between-rounds invariant."""
        kv = self.draft.kv
        before = kv.length
        fanout = self.after_miss[: self.K][None].expand(rows_valid.shape[0], self.K)
        pending = self.t_prev[:, None]
        spec = self.draft.jit(pending, torch.ones_like(pending, dtype=torch.bool), self.K, fanout, rows_valid)
        kv.invalidate(torch.full_like(self.t_prev, before))
        kv.trim()
        return spec

    def _ngram(self, contexts: list[torch.Tensor]) -> Speculation:
        """Fast backup: prompt lookup, proposed as point masses (exact at every temperature)."""
        device = self.draft.kv.device
        tokens, n = ngram_batch(contexts, self.K, self.config.ngram_max, fill=0)
        tokens, n = tokens.to(device), n.to(device)
        q = None if self.greedy else point_mass(tokens, self.draft.vocab_size)
        return Speculation(tokens, n, q, torch.full_like(n, SOURCE_NGRAM))
