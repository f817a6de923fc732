"""The online controller: picks the fastest exact plan from measurement, and re-picks as measurements come in.

Its inputs are the measured cost lines of the pair (control/costs.py), the acceptance it has observed (α, the
bonus token's guessability r, the cache hit rate) and the round times each plan really took. Predictions come from
control/plan.py; a plan that has run replaces its predicted round time by its measured one. What it learns
(control/memory.py) is kept per (target, draft, device, batch size, greedy or sampled) for the life of the process,
so a second generate() call starts from the first one's knowledge. Which plans a call runs to learn rather than
because they are predicted fastest is control/exploration.py's, what starting a plan costs a call
control/starts.py's. A decision never changes the output law: every plan is exact.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from hf_ssd.control.calibration import MIN_ROUNDS, aged_round, calibrated, tail_share
from hf_ssd.control.compiled import (COMPILE_PRIOR_S, built, compile_share, compiled_in_process, compiling_free,
                                     graph_seconds, plan_graphs)
from hf_ssd.control.costs import Costs
from hf_ssd.control.decision import Decision, Horizon, family, retunable, simpler
from hf_ssd.control.exploration import (alpha_exploration, family_exploration, neighbour_look, second_look,
                                        still_exploring, untried_look, untried_score)
from hf_ssd.control.gc_quiet import collections_paused
from hf_ssd.control.learned_line import LearnedLine, measured_parts, tree_forwards
from hf_ssd.control.memory import Memory, Tally, Yield
from hf_ssd.control.plain_loop import faster_plain_loop, in_our_loop
from hf_ssd.control.plan import (MAX_K, Acceptance, Plan, Prediction, Served, candidates, modelled_hit_rate, predict,
                                 verify_s)
from hf_ssd.control.shortlist import candidates_key, make_shortlist
from hf_ssd.control.starts import StartPricing
from hf_ssd.control.tree_cost import TreeCost
from hf_ssd.core.speed_model import expected_tokens_per_round
from hf_ssd.runtime import static_registry

SWITCH_GAIN = 1.10  # switch mid-generation only for a predicted gain of 10% or more (timings are noisy)
SIMPLER_WITHIN = 0.97  # prefer the simpler plan when the fancier one is predicted less than 3% faster
CALL_ALPHA_WEIGHT = 8.0  # pseudo-observations of the setting's pooled α behind a call's own (Controller.acceptance)
# A switch to plain mid-call is priced against the running plan at α this many posterior deviations above the call's
# estimate (Controller._doubt): it lasts the rest of the call, so it waits for rounds that rule drafting out.
SWITCH_OPTIMISM = 1.0


class Controller(StartPricing):
    def __init__(self, costs: Costs, memory: Memory, batch: int, allowed: dict, prior: Acceptance | None = None,
                 fixed_alpha: float | None = None, process_ready: bool = False, plain_compiled: bool = False,
                 draft_compiled: bool = False, target=None, max_length: int | None = None, prompt_len: int = 0,
                 draft=None):
        """allowed: constraints from explicit options, e.g. {"mode": ("ssd",), "K": (4,), "budget": 8,
        "int8": False, "worker": "thread", "threads": (1, 1)}; absent keys are free. process_ready: a kept draft
        process is up (workers.pool), so process-worker plans are candidates beside the thread's. plain_compiled:
        the target runs compiled (ssd_compile_target), so plain shares the other plans' calibration;
        draft_compiled: the draft does (ssd_compile). Either way a plan with new shapes pays their compiles
        (control.compiled; `target`: the model, whose compiled plain loop's measured compile time prices it)."""
        self.target, self.draft = target, draft  # the models, where compiled graphs of theirs are looked up
        self.max_length = max_length  # the call's length limit: our static caches (and graphs) are sized by it
        self.prompt_len = prompt_len  # ... and by its prompt (a synchronous draft's room for holes)
        self.costs, self.memory, self.batch = costs, memory, batch
        self.plain_compiled, self.draft_compiled = plain_compiled, draft_compiled
        self.allowed = allowed
        self.prior = prior or Acceptance()
        self.fixed_alpha = fixed_alpha
        search = {"modes": tuple(allowed.get("mode", ("plain", "sync", "ssd"))),
                  "max_K": max(allowed.get("K", (MAX_K,)))}
        if "budget" in allowed:
            search["budgets"] = (allowed["budget"],)
        self.search = search
        workers = ("thread", "process") if process_ready and "worker" not in allowed else ("thread",)
        plans = [p for p in candidates(costs, **search, workers=workers) if self._permitted(p)]
        if "worker" in allowed:  # an inline tree runs alone, on every thread
            threads = None if allowed["worker"] == "inline" else costs.split
            plans = [replace(p, worker=allowed["worker"], threads=threads) if p.mode == "ssd" else p for p in plans]
        if "threads" in allowed:
            plans = [replace(p, threads=allowed["threads"]) for p in plans]
        self.plans = plans
        self.plans_key = candidates_key(plans)  # the decision shortlist's check that it was made from these plans
        if not self.plans:
            raise ValueError(f"no decoding plan satisfies the given options {allowed}")
        self.call: dict[bool, Tally] = {}  # this call's acceptance per draft precision (a controller serves one call)
        self.optimism = 0.0  # posterior deviations added to α (acceptance): only while pricing a switch to plain
        # A decision predicts every plan (about 200), and each prediction calibrates against every plan that ran:
        # uncached, a decision cost 14 ms on the project's CPU, more than a compiled round. Within one decision
        # nothing is measured, so what the predictions share is computed once (None: outside a decision).
        self._memo: dict | None = None

    def _shared(self, key: tuple, compute):
        """compute(), once per decision for `key`."""
        if self._memo is None:
            return compute()
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def _permitted(self, p: Plan) -> bool:
        a = self.allowed
        if p.mode != "plain" and "K" in a and p.K not in a["K"]:
            return False
        if p.mode == "ssd" and "budget" in a and p.budget != a["budget"]:
            return False
        return "int8" not in a or p.int8 == a["int8"]

    # ---- what the controller believes -------------------------------------------------------------------------
    def acceptance(self, int8: bool = False) -> Acceptance:
        """α of the draft at precision `int8`: this call's own accepted and rejected drafts, behind the setting's
        pooled α (the calls so far, each prompt weighing alike: Memory.alpha) as their prior. Prompts differ: the
        default pair accepts a code answer at α ≈ 0.97 and a chat answer at 0.7, and mid-call every plan must be
        priced at this call's α (priced at the pooled α, a call running K=3 on a code answer saw no gain in K=8).
        Computed once per decision (nothing is measured within one)."""
        return self._shared(("acceptance", int8, self.optimism), lambda: self._acceptance(int8))

    def _acceptance(self, int8: bool) -> Acceptance:
        if self.fixed_alpha is not None:
            alpha = self.fixed_alpha
        else:
            call = self.call.get(int8, Tally())
            alpha = call.posterior(self.memory.alpha(self.prior.alpha, int8), CALL_ALPHA_WEIGHT)
            weight = call.accepted + call.rejected + CALL_ALPHA_WEIGHT
            # the optimistic end of what the call's rounds leave open (the Beta posterior's deviations)
            alpha = min(1.0, alpha + self.optimism * math.sqrt(alpha * (1.0 - alpha) / (weight + 1.0)))
        fit = self.memory.guessability.fit
        r, c = fit if fit is not None else (self.prior.r, self.prior.top1_miss)
        return Acceptance(alpha=alpha, alpha_backup=None, r=r, top1_miss=c)

    def observe_acceptance(self, accepted: float, rejected: float, int8: bool = False, rows: int = 1) -> None:
        """A round's accepted drafts and rejections (rows that did not accept all they had), summed over its `rows`
        drafting rows, of the draft at precision `int8`."""
        # each row that drafted counts towards exploring, as a round of its own: a batch's rows are different
        # prompts, so a batch-16 round says more about α than one row's (counted as one round, a batch-16 setting
        # explored the int8 draft at half speed in one of its five timed calls with α resting on 160 rows' drafts).
        # Plain steps in our loop observe nothing.
        self.memory.add_acceptance(accepted, rejected, rounds=rows if accepted + rejected > 0 else 0, int8=int8,
                                   rows=rows)
        self.call.setdefault(int8, Tally()).add(accepted, rejected)

    def model(self, plan: Plan) -> Prediction:
        """The cost model's prediction, before any calibration (a fresh copy: callers adjust it)."""
        pred = self._shared(("model", plan), lambda: predict(plan, self.costs, self.acceptance(plan.int8),
                                                             self.batch, self.compiled_parts(plan),
                                                             self.served(plan)))
        return replace(pred, parts=dict(pred.parts))

    def served(self, plan: Plan) -> Served | None:
        """What the SSD rounds measured of the cache (plan.Served): `plan`'s own misses where it ran, else those
        of every SSD plan that ran; the yields of rows served from the cache and by a backup, where both were
        seen, else the mode's pooled yield for both."""
        if plan.mode != "ssd":
            return None
        m = self.memory
        misses = m.misses.get(plan) or m.all_misses
        if m.hit_yield and m.miss_yield:
            hit, miss = m.hit_yield.ratio, m.miss_yield.ratio
        else:
            hit = miss = m.ssd_yield.ratio
        return Served(miss_ratio=misses.ratio, hit_yield=hit, miss_yield=miss)

    def compiled_parts(self, plan: Plan) -> dict:
        """Seconds of `plan`'s round parts priced off the compiled rounds measured so far, instead of the eager cost
        lines (control.learned_line.measured_parts)."""
        if plan.mode == "plain" or not (self.draft_compiled or self.plain_compiled):
            return {}
        ratio = self.memory.verify.value if self.memory.verify.n >= MIN_ROUNDS else None
        return measured_parts(plan, self.memory.lines, lambda: predict(plan, self.costs, self.acceptance(plan.int8),
                                                                      self.batch).parts,
                              self.draft_compiled, self.plain_compiled, ratio)

    def record_draft(self, plan: Plan, seconds: float, step_s: float | None = None,
                     forward_s: dict | None = None) -> None:
        """One round's draft work of `plan` (an SSD tree, a synchronous draft) took `seconds`, of which each of its
        forwards took `step_s` on average, and its forwards by width `forward_s` ({tokens per row: (seconds,
        calls)}), where measured."""
        if plan.mode != "plain":
            line = self.memory.lines.setdefault(("draft", family(plan), plan.int8), LearnedLine(proportional=True))
            line.add(tree_forwards(plan), seconds, step_s)
            if forward_s and plan.mode == "ssd":
                self.memory.lines.setdefault(("tree", family(plan), plan.int8), TreeCost()).add(seconds, forward_s)

    def record_tokens(self, plan: Plan, tokens: float, served: tuple[tuple[int, float], tuple[int, float]] | None = None
                      ) -> None:
        """`plan`'s round committed `tokens` per row of the call's batch; called before the round's acceptance is
        observed, so the model prices it at the α in force when it was drafted. served: ((rows the cache served,
        their tokens), (rows a backup served, their tokens)), where the round knows.

        An SSD round's tokens are judged against the acceptance model at that α (the primary draft's tokens per
        round, Memory.ssd_yield): what is left is the mode's own shortfall. A synchronous round is the acceptance
        model itself (K drafts of the one draft model, which α measures), so it keeps the model's figure: its
        measured ratio only said how far the call's α lagged the text (0.87 after a few hard chat answers), and
        priced sync below plain on every call that followed."""
        if plan.mode != "ssd":
            return
        e = expected_tokens_per_round(min(max(self.acceptance(plan.int8).alpha, 0.0), 1.0), plan.K)
        self.memory.ssd_yield.add(tokens, e)
        if served is not None:
            (hit_rows, hit_tokens), (miss_rows, miss_tokens) = served
            if hit_rows:
                self.memory.hit_yield.add(hit_tokens, hit_rows * e)
            if miss_rows:
                self.memory.miss_yield.add(miss_tokens, miss_rows * e)

    def record_lookups(self, plan: Plan, hits: float, lookups: float) -> None:
        """`plan`'s cache answered `hits` of a round's `lookups` (rows): its misses against the model's."""
        if plan.mode != "ssd" or lookups <= 0:
            return
        modelled = lookups * (1.0 - modelled_hit_rate(plan, self.acceptance(plan.int8)))
        for tally in (self.memory.misses.setdefault(plan, Yield()), self.memory.all_misses):
            tally.add(lookups - hits, modelled)

    def record_verify(self, plan: Plan, seconds: float) -> None:
        """One round's verify of `plan` took `seconds`: its ratio to the target's cost line (calibration("plain"))."""
        if plan.mode != "plain":
            self.memory.verify.add(seconds / max(verify_s(plan, self.costs), 1e-9))
            # per family: a thread worker's verify shares the GIL with its tree, a process worker's does not
            line = self.memory.lines.setdefault(("verify", family(plan)), LearnedLine(proportional=False))
            line.add(plan.K + 1, seconds)

    def graphs(self, plan: Plan, in_loop: bool = False) -> frozenset[tuple]:
        return plan_graphs(plan, self.draft_compiled, self.plain_compiled, in_loop, self.max_length, self.prompt_len)

    def mark_compiled(self, plan: Plan, in_loop: bool = False) -> bool:
        """`plan` is running: its graphs are built (or being built) in this process, or its kept draft process.
        Returns whether one of them was new to this setting (its drafter's start then runs it for the first time)."""
        graphs = self.graphs(plan, in_loop)
        new = any(not built(g, self.memory.graphs) for g in graphs)
        self.memory.graphs |= graphs
        return new

    def compile_s(self, plan: Plan, horizon: Horizon, in_loop: bool) -> float:
        """The share of compiling `plan`'s missing graphs this call pays (control.compiled); none in the setting's
        first COMPILE_FREE_CALLS calls (the user's opted-in warm-up; control.compiled.compiling_free)."""
        if not self.memory.graphs or compiling_free(self.memory):
            return 0.0
        missing = {g for g in self.graphs(plan, in_loop) if not built(g, self.memory.graphs)
                   and not self._shared(("in process", g), lambda g=g: compiled_in_process(g, self.target, self.draft,
                                                                                          self.batch))}
        if not missing:
            return 0.0
        spent = static_registry.COMPILE_SPENT
        per_graph = spent["seconds"] / spent["graphs"] if spent["graphs"] else COMPILE_PRIOR_S
        seconds = sum(graph_seconds(g, self.target, per_graph) for g in missing)
        return compile_share(seconds, horizon.tokens, self.memory.generated)

    def horizon(self, limit_left: int, context: int, prefill_share: float = 1.0) -> Horizon:
        """What is left of a call whose limit allows `limit_left` more tokens per row, at `context` tokens per row:
        fewer tokens than the limit where calls here have ended sooner (Memory.call_length)."""
        return Horizon(self.memory.call_length.left(max(limit_left, 0)), context, prefill_share)

    def predict(self, plan: Plan, aged: bool = False, in_loop: bool = False) -> Prediction:
        """The plan's tokens per second: its round time from its measurements where it has run (aged: with old ones
        leaning toward the model, see calibration.aged_round), else from the calibrated model; its tokens per round
        from the acceptance model at this call's α, times its mode's measured yield.

        in_loop: plain runs as one-token rounds of our loop (a switch mid-generation, or a call that starts plain
        there: control.plain_loop), not as transformers' own loop (what plain's measurements and its compiled calibration
        are of): with our per-round work, so it is priced at the hand-off's price or at what such steps measured here
        where they have run (Memory.in_loop_plain), whichever is slower, and with an eager target at least at the
        eager cost line. Priced like a hand-off, a compiled target's eager one-token steps (before they were
        compiled) looked a third faster than they ran; priced at the eager line, switches at batch 16 (overhead
        workload) decoded the rest of the call at ~510 tok/s where staying on synchronous K = 1 made ~660."""
        if in_loop and plan.mode == "plain":
            pred = self.predict(plan, aged=aged)
            measured = self.memory.in_loop_plain
            own = measured.value if measured.n >= MIN_ROUNDS else 0.0
            eager = 0.0 if self.plain_compiled else self.model(plan).round_s  # compiled: the one-token graph
            pred.round_s = max(pred.round_s, eager, own)
            pred.tokens_per_round = self.model(plan).tokens_per_round * tail_share(self.memory, plan, in_loop=True)
            return pred
        pred = self.model(plan)
        measured = self.memory.round_s.get(plan)
        if measured is not None and measured.n >= MIN_ROUNDS:
            value = measured.settled if aged else measured.value  # a call's start: over calls; mid-call: recent
            pred.round_s = aged_round(self, plan, value, pred.round_s) if aged else value
            pred.parts = {**pred.parts, "measured_round": value}
        else:
            pred.round_s = calibrated(self, plan, pred.round_s)
        pred.tokens_per_round *= tail_share(self.memory, plan)
        return pred

    # ---- choosing ---------------------------------------------------------------------------------------------
    @collections_paused()  # its thousands of temporaries would set off collections (control/gc_quiet.py)
    def decide(self, current: Plan | None = None, horizon: Horizon | None = None) -> Decision:
        """The plan to run: at the start of a call (current None), with old measurements aged, so a plan measured
        in a slow spell gets re-checked now and then at no switching cost; mid-generation (current: the running
        plan), from the measurements as they are, switching only for a clear gain.

        horizon: what is left of the call. Then every draft plan but the running one pays its drafter's start (the
        draft's prefill of the context) out of that call: a large batch of long prompts generating a few tokens
        may be faster with plain decoding even where drafting wins per round."""
        began = time.perf_counter()
        shortlist = self.memory.shortlist
        full = shortlist is None or not shortlist.usable(self.plans_key, self.acceptance().alpha)
        plans = self.plans if full else shortlist.restrict(self.plans, current)
        self._memo = {}
        try:
            preds = [self.predict(p, aged=current is None, in_loop=current is not None) for p in plans]
            return self._decide(preds, current, horizon, full)
        finally:
            self._memo = None
            self.memory.decide_s = time.perf_counter() - began

    def _decide(self, preds: list[Prediction], current: Plan | None, horizon: Horizon | None,
                full: bool) -> Decision:
        loop = None
        if horizon is not None:
            for pred in preds:
                self._price_call(pred, horizon, current)
            if current is None:  # plain is ranked by the faster of its two loops
                preds, loop = faster_plain_loop(self, preds, horizon)
        decision = self._choose(preds, current, full)
        return decision if loop is None else in_our_loop(decision, loop)

    def _choose(self, preds: list[Prediction], current: Plan | None, full: bool) -> Decision:
        ran = self._families_ran()
        if current is not None and still_exploring(self, current):
            return Decision(current, f"keeping {current.label}: exploring it, until its own rounds price it",
                            preds[:6], next((p for p in preds if p.plan.mode != "plain"), None))
        score = ((lambda pred: untried_score(self, pred, ran)) if current is None
                 else (lambda pred: pred.call_tokens_per_s))
        preds.sort(key=lambda x: -score(x))
        if full:
            self.memory.shortlist = make_shortlist(preds, self.plans_key, family, self.acceptance().alpha)
        best = preds[0]
        # Among plans within 3% of the fastest, take the simplest (plain, sync, ssd; then the smallest tree): less
        # that can go wrong and less work for the same predicted speed.
        fastest = score(best)
        for pred in preds:
            if score(pred) >= fastest * SIMPLER_WITHIN and simpler(pred.plan, best.plan):
                best = pred
        drafting = next((p for p in preds if p.plan.mode != "plain"), None)
        if current is None and best.plan.mode == "plain":
            explore = alpha_exploration(self, preds, best, drafting)
            if explore is not None:
                return explore
        if current is None:
            explore = (family_exploration(self, preds, best, ran) or untried_look(self, preds, best, ran)
                       or neighbour_look(self, preds, best) or second_look(self, preds, best))
            if explore is not None:
                return explore
        if current is not None and current.mode != "plain" and best.plan.mode == "plain":
            doubt = self._doubt(current, best, preds, drafting)
            if doubt is not None:
                return doubt
        if current is not None and best.plan != current:
            now = next((p for p in preds if p.plan == current), None)
            if now is not None and best.call_tokens_per_s < now.call_tokens_per_s * SWITCH_GAIN:
                return Decision(current, f"keeping {current.label}: {best.plan.label} is predicted "
                                         f"{best.call_tokens_per_s / max(now.call_tokens_per_s, 1e-9):.2f}x, under "
                                         f"the {SWITCH_GAIN:.2f}x needed to switch", preds[:6], drafting)
        return Decision(best.plan, self.explain(best, preds), preds[:6], drafting)

    def _price_call(self, pred: Prediction, horizon: Horizon, current: Plan | None) -> None:
        """Give `pred` what is left of the call (`horizon`) and, unless it is the running plan (`current`), what
        switching to it costs out of that call: its drafter's start and its share of the compiles it needs."""
        pred.horizon = horizon.tokens * self.batch
        if pred.plan == current:
            return
        compiling = self.compile_s(pred.plan, horizon, in_loop=current is not None)
        restart = 0.0 if retunable(current, pred.plan) else self.startup_s(pred.plan, horizon.context)
        if current is None:  # a call's start: the target's prefill too, which costs less in our loop (batches)
            prefill = self.target_prefill_s(pred.plan, horizon.context, horizon.prefill_share)
            restart += prefill
            pred.parts = {**pred.parts, "prefill": prefill}
        pred.startup_s = restart + compiling
        if compiling > 0:
            pred.parts = {**pred.parts, "compile": compiling}

    def measured(self, plan: Plan) -> bool:
        ema = self.memory.round_s.get(plan)
        return ema is not None and ema.n >= MIN_ROUNDS

    def _families_ran(self) -> set[str]:
        """The plan families with a measured plan."""
        return {family(p) for p in self.memory.round_s if self.measured(p)}

    def _doubt(self, current: Plan, plain: Prediction, preds: list[Prediction],
               drafting: Prediction | None) -> Decision | None:
        """Keep drafting when plain wins only at the call's α and not at the optimistic end of what its rounds leave
        open (SWITCH_OPTIMISM posterior deviations); None when plain wins there too. A switch to plain is for the
        rest of the call (plain measures no α to switch back on), and the call's α after a few rounds is noisy: one
        or two rejections at K=7 took the default pair's from 0.79 to 0.70 and a call ran plain where SD was 1.25x
        faster."""
        if self.fixed_alpha is not None:
            return None
        self._memo, self.optimism = {}, SWITCH_OPTIMISM
        try:
            hopeful = self.predict(current, in_loop=True)
            alpha = self.acceptance(current.int8).alpha
        finally:
            self._memo, self.optimism = None, 0.0
        if plain.call_tokens_per_s >= hopeful.tokens_per_s * SWITCH_GAIN:
            return None
        now = self.acceptance(current.int8).alpha
        return Decision(current, f"keeping {current.label}: plain is predicted faster at the call's alpha={now:.2f}, "
                                 f"but not at alpha={alpha:.2f}, which its rounds do not rule out "
                                 f"({hopeful.tokens_per_s:.2f} against plain's {plain.call_tokens_per_s:.2f} tok/s)",
                        preds[:6], drafting)

    @collections_paused()
    def process_option(self, chosen: Plan, horizon: Horizon | None = None, start_s: float = 0.0
                       ) -> Prediction | None:
        """The best process-worker plan when none is up yet, if it is predicted at least SWITCH_GAIN times faster
        than `chosen`: worth starting a kept process for (workers.pool). None when the options fix the worker.

        horizon: price both as a call's start does (each pays its drafter's start and its compiles out of the
        call), and charge the process plans the call's share of the process's own start, `start_s` seconds spread
        over what this setting has generated so far, like a compile (control.compiled.compile_share): a process
        is started once calls here have shown they run long enough to repay it. Priced per round alone and free
        to start, a process was asked for on the overhead workload where its plans, once tried, were priced at
        0.73x the compiled plain decoding every call then ran, and its start slowed the plain steps around it
        (20 -> 27 ms)."""
        if "worker" in self.allowed or any(p.worker == "process" for p in self.plans):
            return None
        plans = [p for p in candidates(self.costs, **self.search, workers=("process",))
                 if p.worker == "process" and self._permitted(p)]
        if not plans:
            return None
        # each call asks: between full evaluations only a shortlist, as decisions do (a full one took 11 ms of the
        # call's first token on the overhead workload)
        listed, key = self.memory.process_shortlist, candidates_key(plans)
        full = listed is None or not listed.usable(key, self.acceptance().alpha)
        plans = plans if full else listed.restrict(plans, None)
        self._memo = {}
        try:
            preds = [self.predict(p, aged=True) for p in plans]
            now = self.predict(chosen, aged=True)
            if horizon is not None:
                share = compile_share(start_s, horizon.tokens, self.memory.generated)
                for pred in (*preds, now):
                    self._price_call(pred, horizon, None)
                for pred in preds:
                    pred.startup_s += share
                    pred.parts = {**pred.parts, "process_start": share}
        finally:
            self._memo = None
        preds.sort(key=lambda x: -x.call_tokens_per_s)
        if full:
            self.memory.process_shortlist = make_shortlist(preds, key, family, self.acceptance().alpha)
        best = preds[0]
        return best if best.call_tokens_per_s >= now.call_tokens_per_s * SWITCH_GAIN else None

    def explain(self, best: Prediction, preds: list[Prediction]) -> str:
        acc = self.acceptance(best.plan.int8)
        runner_up = {m: next((p for p in preds if p.plan.mode == m), None) for m in ("plain", "sync", "ssd")}
        bits = [f"{best.plan.label}: predicted {best.tokens_per_s:.2f} tok/s{_with_startup(best)} at "
                f"alpha={acc.alpha:.2f}"]
        for mode, pred in runner_up.items():
            if pred is not None and pred.plan.mode != best.plan.mode:
                bits.append(f"best {mode} {pred.tokens_per_s:.2f} tok/s{_with_startup(pred)} ({pred.plan.label})")
        parts = best.parts
        measured = parts.get("measured_round")
        if measured is not None and best.round_s < measured * 0.97:
            bits.append(f"re-checking it: measured at {best.tokens_per_round / measured:.2f} tok/s "
                        f"{self.memory.age(best.plan)} rounds ago, possibly in a slow spell")
        if best.plan.mode == "ssd":
            ratio = parts["tree"] / max(parts["verify"], 1e-9)
            bits.append(f"tree of {best.plan.budget} branches = {ratio:.2f} verifies, hit rate ~{best.p_hit:.0%}")
        return "; ".join(bits)


def _with_startup(pred: Prediction) -> str:
    """', X tok/s over this call with its prefills (Y s)' where a start-up (and compiling) was priced in."""
    if pred.startup_s <= 0 or pred.horizon <= 0:
        return ""
    compiling = pred.parts.get("compile", 0.0)
    what = "its prefill" if pred.plan.mode == "plain" else "its prefills"
    what += f" and {compiling:.1f} s of compiling" if compiling > 0 else ""
    return f", {pred.call_tokens_per_s:.2f} over this call with {what} ({pred.startup_s:.1f} s)"
