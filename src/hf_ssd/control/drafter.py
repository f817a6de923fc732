"""A drafter that follows the controller: it runs the chosen plan's drafter, measures every round, and switches to
another exact plan at a round boundary when the controller finds one clearly faster.

A switch closes the current drafter and restarts the new one on the committed tokens, exactly as a fallback
does, so no token is lost and the output law stays the target's.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hf_ssd.control.compiled import compiling_free
from hf_ssd.control.controller import Controller
from hf_ssd.control.decision import Decision, Horizon, family, retunable
from hf_ssd.control.memory import PLAIN_IN_LOOP_TAIL, Memory, TailShare
from hf_ssd.control.plan import Plan
from hf_ssd.core.ranks import distributed, from_rank0
from hf_ssd.core.types import SOURCE_CACHE, SOURCE_NGRAM, DraftResult, Speculation, Verdict
from hf_ssd.draft.protocol import Drafter
from hf_ssd.runtime import static_registry
from hf_ssd.runtime.stats import SSDStats

DECIDE_EVERY = 8  # rounds between re-decisions, at least, unless ...
# ... this many seconds went by: slow rounds (a 1.5B target on a CPU: about a second each) are re-decided every
# round, so a call that started on a poor guess of α corrects it in a few rounds, not after a few dozen tokens
DECIDE_PERIOD_S = 0.25
# ... and the controller's own time at most this share of the rounds' (a decision predicts every plan, about 3 ms
# on the project's CPU: every 8 compiled rounds of 9 ms it took a tenth of the decode time)
DECIDE_SHARE = 0.02
# A switch mid-generation restarts the draft (and may compile new shapes): only when this many decisions in a row
# chose the same other plan. One slow spell in the running plan's round times (a stall, the machine's drift) made
# single decisions hop to slower plans: on the overhead workload at α ≈ 0.7 a compiled SSD call switched to eager
# plain steps on one decision.
CONFIRMATIONS = 2


class ControlledDrafter(Drafter):
    def __init__(self, controller: Controller, build: Callable[..., Drafter], stats: SSDStats,
                 decision: Decision | None = None, disturbed: Callable[[], bool] = lambda: False,
                 max_length: int | None = None):
        """decision: the controller's first decision, if the caller made it already. disturbed: is something else
        taking the hardware right now (then round times are not recorded: they would not be the plan's own)?
        max_length: the call's length limit (prompt included), so a switch is priced with its draft prefill over
        the tokens left."""
        self.controller, self.build, self.stats = controller, build, stats
        self.disturbed = disturbed
        self.max_length = max_length
        decision = decision or agreed(controller.decide())
        self.plan = decision.plan
        self.record = call_record(controller, decision)
        stats.controller = self.record
        # The prompt's prefills (the target's, then the draft's) run alone, on every thread the caller gave; the
        # plan's split of the cores starts with its rounds (start()).
        self.caller_threads = torch.get_num_threads()
        self.current = self._build(self.plan)
        # its start is then not priced (_timed_start); plain in our loop runs the target's one-token graph
        self.new_graphs = controller.mark_compiled(self.plan, in_loop=self.plan.mode == "plain")
        self.prefill_slower_s = 0.0  # what prepare()'s overlapped start added to the target's prefill (modelled)
        self.retired_forwards = 0
        self.rounds = 0
        self.last_start: float | None = None  # when the previous round's resolve began (None: not a plan round)
        # when the last decision ended, and what it cost: the call-start one spaces the first mid-call decision too
        self.last_decision = time.perf_counter()
        self.decide_s = controller.memory.decide_s
        self.decided_at = 0  # self.rounds at the last decision
        self.pending: list[Plan] = []  # the other plans the latest decisions chose (CONFIRMATIONS)
        self.ranks_seen: list[int] = []  # stats.bonus_ranks when last read (_learn_guessability)
        self.compiles_seen = self._compiles()
        self.compiled_last_round = False
        self.round_recorded = False  # did _observe record this round's time (then resolve records its draft work)
        self.unrecorded: tuple | None = None  # the last resolve's (plan, draft s, step s, (hits, lookups))
        self.tokens = 0.0  # committed per row of the call's batch, in the rounds resolved so far

    def _build(self, plan: Plan) -> Drafter:
        """The plan's drafter, its fan-out starting from the α measured so far (pooled over calls, then this call's):
        started from the prior 0.7, a K = 8 tree gave the outcome "all 8 accepted" no branch in a call's first
        round (0.7^8 = 6%), and at α = 1 every call's first lookup missed."""
        if plan.mode != "ssd" or self.controller.memory.alpha_rounds == 0:
            return self.build(plan)
        return self.build(plan, alpha_prior=self.controller.acceptance(plan.int8).alpha)

    @property
    def kind(self) -> str:
        return self.current.kind

    @property
    def memory(self) -> Memory:
        return self.controller.memory

    @property
    def forwards(self) -> int:
        return self.retired_forwards + self.current.forwards

    def prepare(self, prompt: torch.Tensor, mask: torch.Tensor) -> bool:
        """Start the plan's drafter during the target's prefill where that pays (Controller.prefill_overlap); the
        target's prefill then runs on its share of the cores, as the rounds will."""
        slower = self.controller.prefill_overlap(self.plan, prompt.shape[1])
        if slower is None or not self.current.prepare(prompt, mask):
            return False
        self.prefill_slower_s = slower
        self._apply_threads()
        return True

    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        spec = self._timed_start(lambda: self.current.start(prompt, mask), prompt.shape[1], self.prefill_slower_s)
        self.prefill_slower_s = 0.0
        self._apply_threads()
        return spec

    def _timed_start(self, start: Callable[[], Speculation], context: int, extra_s: float = 0.0) -> Speculation:
        """Run the drafter's start (its prefill of `context` tokens per row) and calibrate what starts cost: the
        wait for it, plus `extra_s` it cost elsewhere (an overlapped start's slower target prefill). Not where the
        plan's graphs are new to this setting: the start is then their first run (a draft process's start after
        compiling took 232x the model on the overhead workload: loading and first runs of the new graphs)."""
        began = time.perf_counter()
        spec = start()
        if self.plan.mode != "plain" and not self.disturbed() and not self.new_graphs:
            self.controller.record_startup(self.plan, context, time.perf_counter() - began + extra_s)
        return spec

    def begin(self, spec: Speculation) -> None:
        self.spec = spec
        self.current.begin(spec)

    def resolve(self, verdict: Verdict) -> DraftResult:
        now = time.perf_counter()
        self.rounds += 1
        # under torch.distributed every rank must decide in the same rounds (a decision is a collective): by round
        # count only, since the ranks' clocks differ
        seconds_since, decide_s = (0.0, 0.0) if distributed() else (now - self.last_decision, self.decide_s)
        deciding = (decision_due(self.rounds - self.decided_at, seconds_since, decide_s)
                    and self._switch_could_pay(verdict))
        compiles = self._compiles()
        # Where no decision is due, a drafter elsewhere (a draft process) starts on the outcome first: the round's
        # bookkeeping below then overlaps its lookup instead of delaying it (0.5 ms a round at batch 1).
        if not deciding:
            self.current.send(verdict)
        self._record_resolve()
        self.tokens += self._observe(verdict, now)
        self._learn_guessability()
        if deciding:
            self.decided_at = self.rounds
            began = time.perf_counter()
            decision = agreed(self.controller.decide(self.plan, self._horizon(verdict)))
            self.last_decision, self.decide_s = time.perf_counter(), time.perf_counter() - began
            self.pending = [*self.pending, decision.plan][-CONFIRMATIONS:] if decision.plan != self.plan else []
            if len(self.pending) == CONFIRMATIONS and all(p == decision.plan for p in self.pending):
                self.pending = []
                return self._switch(decision, verdict)
        result = self.current.resolve(verdict)
        # recorded at the next round's start, while the drafter works on that one (or at close)
        draft_s = result.draft_s if self.round_recorded and self._compiles() == compiles else None
        timed = draft_s is not None and self.plan.mode == "ssd"
        step_s = self.stats.draft_step_s if timed else None
        forward_s = self.stats.draft_forward_s if timed else None
        # the hits now: a draft process's may sit in a buffer the next round writes
        lookups = None if result.hits is None else (float(result.hits.sum()), result.hits.numel())
        self.unrecorded = (self.plan, draft_s, step_s, forward_s, lookups)
        return result

    def _switch_could_pay(self, verdict: Verdict) -> bool:
        """Is enough of the call left for a decision now to matter? A switch takes CONFIRMATIONS decisions in a row,
        each as far from the last as this one, and then needs rounds to repay its restart: with fewer rounds left
        than that, a decision only costs its time (2-3 ms on the project's CPU against compiled rounds of 8 ms; a
        64-token call of the overhead workload made one mid-call decision, and could not have switched on it)."""
        resolved = self.rounds - 1  # this round's tokens are observed after the check
        if self.max_length is None or not verdict.contexts or resolved <= 0 or self.tokens <= 0:
            return True
        rounds_left = (self.max_length - max(c.shape[0] for c in verdict.contexts)) / (self.tokens / resolved)
        return rounds_left >= (self.rounds - self.decided_at) * (CONFIRMATIONS - len(self.pending))

    def _record_resolve(self) -> None:
        """The last resolve's draft work and cache lookups, to the controller."""
        if self.unrecorded is None:
            return
        (plan, draft_s, step_s, forward_s, lookups), self.unrecorded = self.unrecorded, None
        if draft_s is not None:
            self.controller.record_draft(plan, draft_s, step_s, forward_s)
        if lookups is not None:
            self.controller.record_lookups(plan, *lookups)

    def close(self) -> None:
        self.current.close()
        self._record_resolve()
        self._learn_guessability()  # the last rounds' ranks: the drafter learns from a round after answering it

    # ---- measuring ------------------------------------------------------------------------------------------------
    def _compiles(self) -> tuple:
        """What has compiled so far: our graphs built in this process, and the seconds the draft's cache spent
        compiling (a draft process's arrive with its answers)."""
        return static_registry.COMPILE_SPENT["graphs"], self.stats.draft_compile_s

    def _compiled_lately(self) -> bool:
        """Did this round or the one before compile something? Either round's time is then the compiler's, not the
        plan's: a draft process's compile in round r is reported with its answer, so it shows at round r + 1, whose
        wait it lengthened. Recorded, a compiling call's rounds priced compiled sync SD at 26 ms a round against
        16 ms on the overhead workload at α ≈ 0.7, and it was not run again for the rest of the bench."""
        seen = self._compiles()
        now, self.compiles_seen = seen != self.compiles_seen, seen
        if now:
            self.memory.cold.add(self.plan)
        lately, self.compiled_last_round = now or self.compiled_last_round, now
        return lately

    def _observe(self, verdict: Verdict, now: float) -> float:
        """Acceptance from this round's outcome; the plan's round time from one resolve's start to the next's, and
        its tokens per round, from rounds in which every row of the call was still decoding. Returns the round's
        committed tokens per row of the call."""
        # as Python lists: a round's few rows cost less so than a dozen tiny tensor ops (0.3 ms a round at batch 1)
        k = verdict.outcome.accepted.tolist()
        n = self.spec.n.tolist()
        source = None if self.spec.source is None else self.spec.source.tolist()
        # The engine drops the rows that finished: a batch's last rounds decode fewer rows, and how much cheaper they
        # are depends on the hardware (Memory.tail). A plan's round time and yield come from its full rounds.
        full = len(k) == self.controller.batch
        tokens = (sum(k) + len(k)) / self.controller.batch  # per row (the backup's weaker proposals included)
        if full:  # before observing: priced at the α it was drafted at
            self.controller.record_tokens(self.plan, tokens, served_rows(source, k))
        # α is the draft model's: rows the n-gram backup served after a cache miss accept far less (their shortfall
        # is the SSD mode's yield), and counted in α they made every drafting plan look worse than plain
        primary = [i for i in range(len(k)) if n[i] > 0 and (source is None or source[i] != SOURCE_NGRAM)]
        self.controller.observe_acceptance(float(sum(k[i] for i in primary)), float(sum(k[i] < n[i] for i in primary)),
                                           int8=self.plan.int8, rows=len(primary))
        # Plain steps inside our round loop (a switch to plain mid-generation) are not the plain a call's start
        # prices: that runs transformers' own loop, measured there (record_plain), about 1.6x faster per step at
        # batch 16 on the overhead workload. Mixed in, they made plain look slow for good; they price themselves
        # (Memory.in_loop_plain, read by Controller.predict for a switch mid-call).
        in_loop_plain = self.plan.mode == "plain"
        # disturbed: something else takes the hardware now (a kept process starting), so the time is not the plan's
        compiled = self._compiled_lately()
        self.round_recorded = False
        if self.last_start is not None and not compiled and not self.disturbed():
            seconds = now - self.last_start
            if in_loop_plain:
                measured = self.memory.in_loop_plain
                tail = self.memory.tail.setdefault(PLAIN_IN_LOOP_TAIL, TailShare())
                tail.add(seconds, len(k) / self.controller.batch, measured.value if measured.n else None)
                if full:
                    measured.add(seconds)
            else:
                measured = self.memory.round_s.get(self.plan)
                tail = self.memory.tail.setdefault(family(self.plan), TailShare())
                tail.add(seconds, len(k) / self.controller.batch, None if measured is None else measured.value)
                if full:
                    self.round_recorded = True  # its draft work is recorded too, once resolve has its span
                    self.memory.record_round(self.plan, seconds, tokens=tokens)
                    if verdict.verify_s > 0:
                        self.controller.record_verify(self.plan, verdict.verify_s)
        self.last_start = now
        return tokens

    def _learn_guessability(self) -> None:
        """The bonus ranks an SSD drafter counted since the last round (stats.bonus_ranks) go to the controller's
        memory. The counts are a drafter's own: a kept process's begin again at each call, so counts that went down
        are a new drafter's, taken whole."""
        counts = list(self.stats.bonus_ranks)
        seen = self.ranks_seen
        if len(seen) != len(counts) or sum(counts) < sum(seen):
            seen = [0] * len(counts)
        self.ranks_seen = counts
        new = [max(c - s, 0) for c, s in zip(counts, seen)]
        if sum(new) > 0:
            self.memory.guessability.add(new)

    def _horizon(self, verdict: Verdict) -> Horizon | None:
        """What is left of the call: a switch restarts the draft on the longest row's context."""
        if self.max_length is None or not verdict.contexts:
            return None
        context = max(c.shape[0] for c in verdict.contexts)
        return self.controller.horizon(self.max_length - context, context)

    def _switch(self, decision, verdict: Verdict) -> DraftResult:
        before = self.plan
        self.record["switches"].append({"round": self.rounds, "from": before.label, "to": decision.plan.label,
                                        "reason": decision.reason})
        self.stats.controller = self.record
        self.record["choice"] = decision.plan.label
        if retunable(before, decision.plan) and self.current.retune(decision.plan.K):
            # only K changes: the draft keeps its cache, and this round's outcome is resolved as usual
            self.plan = decision.plan
            self.controller.mark_compiled(self.plan, in_loop=True)
            return self.current.resolve(verdict)
        self.retired_forwards += self.current.forwards
        self.current.close()
        self.plan = decision.plan
        torch.set_num_threads(self.caller_threads)  # the restart's prefill runs alone, on every thread
        self.current = self._build(self.plan)
        self.new_graphs = self.controller.mark_compiled(self.plan, in_loop=True)
        context = max(c.shape[0] for c in verdict.contexts)
        spec = self._timed_start(lambda: self.current.restart(verdict.contexts, verdict.masks()), context)
        self._apply_threads()
        self.last_start = None  # the restart's prefill is not a round of the new plan
        return DraftResult(spec)

    def _apply_threads(self) -> None:
        torch.set_num_threads(self.plan.threads[0] if self.plan.threads is not None else self.caller_threads)


def decision_due(rounds_since: int, seconds_since: float, decide_s: float) -> bool:
    """Re-decide every DECIDE_EVERY rounds or DECIDE_PERIOD_S seconds, whichever comes first, unless the last
    decision (`decide_s` seconds) would take more than DECIDE_SHARE of the time since it: a fast plan's short rounds
    are not spent predicting, and a slow plan's are re-checked every round."""
    if rounds_since < 1 or seconds_since * DECIDE_SHARE < decide_s:
        return False
    return rounds_since >= DECIDE_EVERY or seconds_since >= DECIDE_PERIOD_S


def agreed(decision: Decision) -> Decision:
    """Under torch.distributed (a tensor-parallel target), every rank takes rank 0's decision (core.ranks)."""
    return from_rank0(decision)


def call_record(controller: Controller, decision: Decision, note: str = "") -> dict:
    """What a call's stats say about the controller: the plan it started on, why, and what it predicted for each
    plan (the same record whether the call then runs a drafter or hands plain decoding to transformers)."""
    return {"choice": decision.plan.label, "reason": decision.reason + note, "switches": [],
            "predicted": [_row(p) for p in decision.table], "probe_s": round(controller.costs.probe_s, 4),
            # a plan run to measure it, not the controller's choice (control.exploration)
            "exploring": decision.choice is not None,
            # one of the setting's first calls, which compile whatever they choose (control.compiled): a warm-up
            "compiling_free": compiling_free(controller.memory)}


def _row(pred) -> dict:
    """One plan's prediction and the parts of its round; where the call priced a start-up (draft prefill,
    compiling), also the speed over the call that the decision ranked by, and the compiling in it (a plan fast per
    round but with graphs to build ranks below slower built ones)."""
    row = {"plan": pred.plan.label, "tok_s": round(pred.tokens_per_s, 3), "round_s": round(pred.round_s, 5),
           "p_hit": None if pred.p_hit is None else round(pred.p_hit, 3)}
    if pred.startup_s > 0 and pred.horizon > 0:
        row["call_tok_s"] = round(pred.call_tokens_per_s, 3)
    if pred.parts.get("compile", 0.0) > 0:
        row["compile_s"] = round(pred.parts["compile"], 3)
    # what the round was priced from (seconds: verify, tree or draft, backup, a measured round): a misprice shows
    # which part was off
    row["parts"] = {name: round(seconds, 5) for name, seconds in pred.parts.items() if name != "compile"}
    return row


def served_rows(source: list[int] | None, accepted: list[int]) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """((rows the speculation cache served, their tokens), (rows a backup served, their tokens)) of a round whose
    rows (sources `source`, SOURCE_*) accepted `accepted` drafts; None where the speculation does not say."""
    if source is None:
        return None
    hit = [a + 1 for s, a in zip(source, accepted) if s == SOURCE_CACHE]
    miss = [a + 1 for s, a in zip(source, accepted) if s != SOURCE_CACHE]
    return (len(hit), float(sum(hit))), (len(miss), float(sum(miss)))
