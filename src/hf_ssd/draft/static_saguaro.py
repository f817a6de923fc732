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

One difference does change what is drafted (`REUSE_TREE`, K >= 2): the glue forward is mostly redundant. After a
hit, the branch's tree steps already fed t*, d_1..d_{K-1} at the right positions and computed the draft's scores
after each; after a JIT backup, so did its single steps. So the next round keeps that KV (the branch's tree slots
are copied to the row's next slots, `StaticCachedModel.copy_slots`; the JIT's stay where they are) and those
scores, and instead of a glue forward its first tree step also feeds the last draft d_n (one forward of N + 1
tokens): the tree costs K forwards instead of K + 1. The branches that assume all n drafts accepted need d_n's
scores to pick their bonus guesses, so they start one step later and draft K - 1 tokens (a speculation with fewer
drafts, which the verifier already handles). Rounds after an n-gram backup (nothing to reuse) run the glue as before.
Exactness does not depend on it: every draft is still verified against the q it was drawn from.
"""
from __future__ import annotations

import torch

from hf_ssd.config import SSDConfig
from hf_ssd.core.backup import Mean
from hf_ssd.core.device_span import DeviceSpan
from hf_ssd.core.sampling import BAD_PROBS, sample, saguaro_probs
from hf_ssd.core.speed_model import expected_tokens_per_round
from hf_ssd.core.tree import fork, tree_width
from hf_ssd.core.types import DraftResult, Forks, Speculation, Verdict
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.saguaro import SaguaroDrafter, SpeculationCache
from hf_ssd.runtime.slot_step import SlotAttend
from hf_ssd.runtime.stats import SSDStats

REUSE_TREE = True  # False: always run the glue forward (drafts exactly what the dynamic SaguaroDrafter drafts)
REUSE_MARGIN, REUSE_SLACK = 1.25, 0.02  # carry over only if the round gets shorter by 1.25x the token loss + 2%
REUSE_MIN_ROUNDS = 8  # rows' rounds observed before the α estimate is trusted to decide


class StaticSaguaroDrafter(SaguaroDrafter):
    def __init__(self, draft: DraftModel, config: SSDConfig, stats: SSDStats, budget: int, greedy: bool):
        super().__init__(draft, config, stats, budget, greedy)
        kv = draft.kv
        self.N = tree_width(config, self.K, budget, draft.vocab_size)
        device = kv.device
        self.glue_ids = torch.arange(self.K + 1, device=device)
        self.branch_ids = torch.arange(self.N, device=device)
        self.causal = torch.full((1, 1), -1, dtype=torch.long, device=device)  # SlotAttend branch of a non-tree token
        self._bad = None  # [] bool on the device: some tree q had NaN, inf or a negative entry
        self.reuse = REUSE_TREE and self.K >= 2  # K = 1: the delayed branches would draft nothing
        self.carried: torch.Tensor | None = None  # [B, K, V] scores at draft positions 0..K-1 of the next glue
        # for _jit: (hit rows, their carried scores), or (None, None) when every row is the JIT's; None: keep nothing
        self._hits: tuple | None = None
        self.t_forward = Mean()  # seconds of one tree forward (the tree's time over its forwards)
        self.tree_scores: list[torch.Tensor] | None = None  # each tree step's [B, N, V] scores, kept for _carry_over
        stats.draft_static = True

    def _plan(self) -> None:
        super()._plan()
        self.hit_host = list(self.stats.fanout_after_hit)  # host copies: no device read to size the math
        # a short speculation's all-accepted position takes F_n + ... + F_K (`_fanout`): at most a schedule's sum
        self.f_max = max(1, sum(self.hit_host), sum(self.stats.fanout_after_miss))

    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        self.carried = None
        # the first speculation is a JIT's: it can carry over like any other (once there are timings to say so)
        self._hits = (None, None) if self.reuse and self._reuse_pays() else None
        return super().start(prompt, mask)

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
        """The K (+ 1) fixed-shape forwards of the tree; every shape and loop bound is known on the host."""
        self.spec = spec
        if self.carried is not None:
            carried, self.carried = self.carried, None
            self._begin_reused(spec, carried)
        else:
            self._begin_glue(spec)

    def _begin_glue(self, spec: Speculation) -> None:
        """The glue forward over [t_prev, d_1..d_K], then K tree steps of N branches."""
        kv, K, N = self.draft.kv, self.K, self.N
        tokens, n = spec.tokens.to(kv.device), spec.n.to(kv.device)
        B = tokens.shape[0]
        fanout = self._fanout(spec.source.to(kv.device), n)
        glue = kv.write_pointer()  # [B] slot of t_prev in each row
        self.glue_start = glue
        start = kv.next_position()
        glue_valid = torch.cat([torch.ones_like(n[:, None], dtype=torch.bool),
                                self.glue_ids[None, :K] < n[:, None]], dim=1)
        positions = start[:, None] + self.glue_ids
        block = torch.cat([self.t_prev[:, None], tokens], dim=1)
        self.glue_scores = self.draft.scores(kv.forward(block, positions, glue_valid))
        forks = fork(self.glue_scores, tokens, n, fanout, width=N, f_max=self.f_max)
        self.tree0 = glue + K + 1
        attend = SlotAttend(glue[:, None] + forks.depth, self.branch_ids[None].expand(B, N), self.tree0)
        steps = []
        current = forks.tokens
        for step in range(1, K + 1):
            pos = start[:, None] + forks.depth + step
            scores = self.draft.scores(kv.forward(current, pos, forks.valid, attend))
            current, q = self._propose_no_sync(scores, self.hit_host[step - 1])
            steps.append((scores, current, q))
        self._finish_tree(forks, steps, None)

    def _begin_reused(self, spec: Speculation, carried: torch.Tensor) -> None:
        """The glue's KV and scores at positions 0..n-1 carried over (see the module doc): the first tree step also
        feeds d_n, whose scores give the bonus guesses of the branches that assume every draft accepted; those
        ("delayed") branches start one step later."""
        kv, K, N = self.draft.kv, self.K, self.N
        tokens, n = spec.tokens.to(kv.device), spec.n.to(kv.device)
        B = tokens.shape[0]
        fanout = self._fanout(spec.source.to(kv.device), n)
        w = kv.write_pointer()  # [B] the slot d_n goes to: t_prev, d_1..d_{n-1} are below it
        glue = w - n
        self.glue_start = glue
        start = kv.next_position() - n  # logical position of t_prev
        last = tokens.gather(1, (n - 1)[:, None])  # d_n
        # position n's scores are not known yet; fork's layout does not depend on them (nothing is excluded there)
        placeholder = torch.cat([carried, carried[:, :1]], dim=1)
        forks = fork(placeholder, tokens, n, fanout, width=N, f_max=self.f_max)
        delayed = forks.valid & (forks.depth == n[:, None])
        self.tree0 = w + 1
        first = torch.cat([last, forks.tokens], dim=1)
        first_valid = torch.cat([torch.ones_like(last, dtype=torch.bool), forks.valid & ~delayed], dim=1)
        first_pos = torch.cat([(start + n)[:, None], start[:, None] + forks.depth + 1], dim=1)
        lim = torch.cat([w[:, None], glue[:, None] + forks.depth], dim=1)
        branch = torch.cat([self.causal.expand(B, 1), self.branch_ids[None].expand(B, N)], dim=1)
        scores = self.draft.scores(kv.forward(first, first_pos, first_valid, SlotAttend(lim, branch, self.tree0)))
        after_last = scores[:, 0]
        V = after_last.shape[-1]
        self.glue_scores = placeholder.scatter(1, n[:, None, None].expand(B, 1, V), after_last[:, None])
        # the delayed branches' guesses: the top tokens after d_n, in rank order (as `fork` orders them)
        f = min(self.f_max, V)
        rank = (delayed.long().cumsum(dim=1) - 1).clamp(0, f - 1)
        guesses = after_last.topk(f, dim=-1).indices.gather(1, rank)
        forks = Forks(torch.where(delayed, guesses, forks.tokens), forks.depth, forks.valid)
        current, q = self._propose_no_sync(scores[:, 1:], self.hit_host[0])
        steps = [(scores[:, 1:], current, q)]
        attend = SlotAttend(glue[:, None] + forks.depth, self.branch_ids[None].expand(B, N), self.tree0)
        for step in range(2, K + 1):
            feed = torch.where(delayed, forks.tokens, current) if step == 2 else current
            pos = start[:, None] + forks.depth + step - delayed.long()
            scores = self.draft.scores(kv.forward(feed, pos, forks.valid, attend))
            current, q = self._propose_no_sync(scores, self.hit_host[step - 1])
            steps.append((scores, current, q))
        self._finish_tree(forks, steps, delayed)

    def _finish_tree(self, forks: Forks, steps: list, delayed: torch.Tensor | None) -> None:
        """The speculation cache from the K steps' (scores, tokens, q): a delayed branch's drafts are its tokens of
        steps 2..K (delayed None: no branch is). Keeps every step's scores for the next round to reuse, only where
        it may (K [B, N, V] tensors: hundreds of MB at batch 16 with a 150k vocabulary)."""
        keep = self.reuse and self._reuse_pays()
        self.tree_scores = [scores for scores, _, _ in steps] if keep else None
        self.delayed = delayed if delayed is not None else torch.zeros_like(forks.valid)

        def per_branch(xs: list, mask: torch.Tensor | None) -> torch.Tensor:
            if mask is None:
                return torch.stack(xs, dim=2)
            later = xs[1:] + xs[-1:]  # a delayed branch's j-th draft; its last slot is padding (n = K - 1)
            return torch.stack([torch.where(mask, b, a) for a, b in zip(xs, later)], dim=2)

        tokens = per_branch([t for _, t, _ in steps], delayed)
        q_all = None if self.greedy else per_branch([q for _, _, q in steps],
                                                    None if delayed is None else delayed[..., None])
        n = None if delayed is None else self.K - delayed.long()
        self.cache = SpeculationCache(forks, tokens, q_all, n)

    # ---- carrying the tree over to the next round -------------------------------------------------------------------
    def _carry_over(self, hit: torch.Tensor, src_rows: torch.Tensor, branch: torch.Tensor, n: torch.Tensor,
                    backup: str | None) -> None:
        """Rows that hit keep their branch's KV (copied from its tree slots to the row's next slots) and scores; a
        JIT backup keeps its own (`_jit`). An n-gram backup computed nothing to keep: then every row runs the glue."""
        self._hits = None
        tree_scores, self.tree_scores = self.tree_scores, None  # not kept past this round (memory)
        if tree_scores is None or backup == "ngram" or not self._reuse_pays():
            return
        self.stats.tree_reused += 1
        kv, K, N = self.draft.kv, self.K, self.N
        w = kv.write_pointer()  # [B'] each kept row's next slot: where its bonus token t* goes
        rows = hit.nonzero().squeeze(1)
        j = torch.arange(K, device=w.device)[None]  # [1, K] glue position of t*, d_1..d_{K-1}
        # a branch with n drafts fed t*, d_1..d_{n-1} in its last n steps: step K - n + 1 + j holds position j
        step = (j + K - n[:, None]).clamp_max(K - 1)  # 0-based
        src = self.tree0[src_rows, None] + step * N + branch[:, None]
        keep = j < n[:, None]
        dst = torch.where(keep, w[rows, None] + j, w[rows, None] + n[:, None])  # padding -> d_n's slot (rewritten)
        all_src = w[:, None].repeat(1, K)
        all_dst, all_keep = all_src.clone(), torch.zeros_like(all_src, dtype=torch.bool)
        all_src[rows], all_dst[rows], all_keep[rows] = src, dst, keep
        kv.copy_slots(all_src, all_dst, all_keep)
        new_w = w.clone()
        new_w[rows] = w[rows] + n
        kv.set_pointer(new_w)
        kv.trim()
        # scores at draft positions 0..K-1 of the branch (positions n.. are never read)
        picked = torch.stack([s[src_rows, branch] for s in tree_scores], dim=1)  # [H, K, V] by step
        scores = picked.gather(1, step[..., None].expand(-1, -1, picked.shape[-1]))
        if backup is None:  # every row hit
            self.carried = scores
        else:
            self._hits = (rows, scores)

    def begin(self, spec: Speculation) -> None:
        self.settle()  # the previous round's learning (host reads), before the hot path
        t0 = self.stats.now()
        self._bad = None
        forwards = self.K if self.carried is not None else self.K + 1
        kv = self.draft.kv
        calls, compile_s = kv.compiled_calls, kv.compile_s
        on_cpu = kv.device.type == "cpu"  # a CUDA graph's launch returns before it has run: nothing to time there
        by_width = {n: tuple(v) for n, v in kv.width_run.items()} if on_cpu else {}
        self.tree_span = DeviceSpan(kv.device)
        self.begin_no_sync(spec)
        self.tree_span.stop()
        self.tree_forwards = forwards
        self.draft_span = (t0, self.stats.now())
        # only where every forward ran a compiled graph and none compiled (else no reading for this tree)
        timed = on_cpu and kv.compiled_calls - calls == forwards and kv.compile_s == compile_s
        self.stats.draft_forward_s = _forwards_since(by_width, kv.width_run) if timed else None
        self.stats.draft_step_s = (sum(s for s, _ in self.stats.draft_forward_s.values()) / forwards if timed
                                   else None)
        self.stats.draft_compile_s = round(kv.compile_s, 4)
        self.stats.draft_compiled = self.draft.kv.compiled_calls > 0

    # ---- off the hot path ---------------------------------------------------------------------------------------
    def resolve(self, verdict: Verdict) -> DraftResult:
        if self._bad is not None and bool(self._bad):  # a NaN must never become a token (see check_probs)
            raise RuntimeError(BAD_PROBS)
        return super().resolve(verdict)

    def _tree_timed(self) -> float | None:
        tree_s = super()._tree_timed()
        if tree_s is not None:
            self.t_forward.add(tree_s / self.tree_forwards)
        return tree_s

    def _reuse_pays(self) -> bool:
        """Carrying the tree over saves one of the tree's K + 1 forwards, which shortens the round where the tree is
        the slower side, but a round whose drafts were all accepted is then followed by a speculation of K - 1
        drafts: about α^(2K) fewer tokens per round (α^K of the rounds, each losing α^K). Decided from the measured
        verify and tree-forward times and the estimated α (host numbers, no device read), with a margin: the loss
        in tokens is certain, the saving is a noisy timing and leaves out the KV copy. At α = 1 it never pays (the
        overhead workload at α = 1 lost a fifth of its tokens for a round that did not get a fifth shorter)."""
        v, f = self.backup.t_verify.value, self.t_forward.value
        fixed = self.planner.alpha[0]
        # the α estimate starts at a prior of 0.7: near α = 1 the first rounds of every call would carry over
        if v is None or f is None or (fixed is None and self.planner.hit.alpha.n < REUSE_MIN_ROUNDS):
            return False
        K = self.K
        alpha = min(max(fixed if fixed is not None else self.planner.hit.alpha.value, 0.0), 1.0)
        loss = alpha ** (2 * K) / expected_tokens_per_round(alpha, K)
        saving = 1.0 - max(v, K * f) / max(v, (K + 1) * f)
        return saving > REUSE_MARGIN * loss + REUSE_SLACK

    def _jit(self, rows_valid: torch.Tensor) -> Speculation:
        """Neural backup (its single steps run compiled). Then every row's pointer goes back to where it was, or,
        when the tree is carried over (`_carry_over`), the backup's rows keep the KV of t*, d_1..d_{K-1} it wrote and
        its scores, for the next round's first tree step."""
        kv = self.draft.kv
        before = kv.write_pointer()
        fanout = self.after_miss[: self.K][None].expand(rows_valid.shape[0], self.K)
        pending = self.t_prev[:, None]
        spec = self.draft.jit(pending, torch.ones_like(pending, dtype=torch.bool), self.K, fanout, rows_valid)
        hits, self._hits = self._hits, None
        if hits is None:
            kv.invalidate(before)
        else:
            kv.invalidate(torch.where(rows_valid.to(before.device), before + self.K, before))
            carried = torch.stack(self.draft.jit_scores, dim=1)
            rows, scores = hits
            if rows is not None:  # rows that hit carry their branch's scores
                carried[rows] = scores
            self.carried = carried
        kv.trim()
        return spec

    def close(self) -> None:
        super().close()
        self.draft.kv.release()


def _forwards_since(before: dict, now: dict) -> dict[int, tuple[float, int]]:
    """{width: (seconds, calls)} of the compiled forwards between two readings of StaticKV.width_run."""
    out = {}
    for n, (seconds, calls) in now.items():
        s0, c0 = before.get(n, (0.0, 0))
        if calls > c0:
            out[n] = (seconds - s0, calls - c0)
    return out
