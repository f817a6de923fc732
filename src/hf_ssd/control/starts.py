"""What starting a plan costs a call, before its first round: the draft's prefill (and an SSD plan's first
speculation), calibrated by the starts measured here, and the target's prefill where the two loops prefill it
differently. A part of the Controller (it reads the controller's costs, memory and compiled lines)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hf_ssd.control.decision import family
from hf_ssd.control.plan import Plan

if TYPE_CHECKING:
    from hf_ssd.control.costs import Costs
    from hf_ssd.control.memory import Memory


class StartPricing:
    costs: Costs
    memory: Memory
    draft_compiled: bool

    def startup_model(self, plan: Plan, context: int) -> float:
        """Modelled seconds of starting `plan`'s drafter on `context` tokens per row: the draft's prefill (all
        threads: the target waits for it) and, for SSD, its first K drafts (the first speculation, drafted before
        the first verify with nothing to hide under). A synchronous plan's first drafts are its first round's, priced
        in its rounds like every round's: priced here too, at the eager draft step's cost, they charged sync K = 8 a
        call's 25 ms more than K = 2 on the overhead workload (compiled steps take 0.6 ms), and at α = 1 `ssd=True`
        ran K = 2 there. Plain decoding has no draft to start.

        A compiled draft's first speculation runs its compiled steps, priced as an SSD miss's JIT backup (K steps
        of one token): at the eager step's cost (~4 ms against ~1 ms on the overhead workload's draft process) SSD
        K = 8 paid a 64-token call's 25 ms more than K = 2, and lost to it by the 3% a simpler plan may lose by."""
        if plan.mode == "plain":
            return 0.0
        draft = self.costs.draft(False, plan.int8)
        if plan.mode != "ssd":
            return draft(context)
        compiled = self.compiled_parts(plan).get("backup") if self.draft_compiled else None
        return draft(context) + (compiled if compiled is not None else plan.K * draft(1))

    def startup_s(self, plan: Plan, context: int) -> float:
        """startup_model, calibrated by the starts measured so far (a long prefill is compute-bound: the cost
        line, timed on short forwards, may be off by a constant factor)."""
        return self.startup_model(plan, context) * self.memory.startup_ratio(family(plan))

    def target_prefill_s(self, plan: Plan, context: int, share: float = 1.0, in_loop: bool = False) -> float:
        """What the target's prefill of `context` prompt columns costs a call starting on `plan` beyond the cheaper
        path's: plain decoding runs it in transformers' loop, a draft plan in ours, which prefills rows of similar
        length together (runtime.prefill: about half the compute of a padded batch of MT-Bench prompts at batch 4).
        As measured here per padded column (Memory.prefill), ours scaled by this call's `share` (our grouped
        prefill's tokens against the padded batch's); while only one path has run, the other costs the same per
        padded column. Before either has run, plain's padded prefill is the target's cost line at `context` tokens
        (timed on a few tokens per row and extrapolated: a rough price, replaced by the first measured prefill).
        Until session 42 nothing was priced before both had run, and the default pair at batch 16 ran plain in every
        call of a bench: its padded prefill took 81 s, our loop's 29. Until session 43 ours was priced per column
        of whichever batches it had run: at batch 4 a batch of similar prompts (share 0.85) set a price that made a
        batch of one long and three short prompts (0.44) look as cheap to prefill padded: it started plain, whose
        first token came after 17 s, our SD's after 8. Only the difference: the share every plan pays would rank
        nothing and, added to every call, would bring slower plans within the explorations' reach
        (control.exploration compares speeds over the call). A plain call that cannot be handed off (a generator
        given) prefills in our loop but is priced as handed off; `in_loop`: plain decoding that starts in our loop
        (control.plain_loop), which prefills as a draft plan does."""
        handed_off = plan.mode == "plain" and not in_loop
        plain, engine = self.memory.prefill_column_s("plain"), self.memory.prefill_column_s("engine")
        if not (plain or engine):
            padded = self.costs.target(False)(context)
            return (1 - min(share, 1.0)) * padded if handed_off else 0.0
        plain, engine = plain or engine, (engine or plain) * min(share, 1.0)
        own = plain if handed_off else engine
        return (own - min(plain, engine)) * context

    def record_startup(self, plan: Plan, context: int, seconds: float) -> None:
        modelled = self.startup_model(plan, context)
        if modelled > 0:
            self.memory.record_startup(family(plan), seconds / modelled)

    def prefill_overlap(self, plan: Plan, context: int) -> float | None:
        """Should `plan`'s drafter prefill while the target does (Drafter.prepare: a draft process can, and a thread
        on its own CUDA stream), each side on its share of the cores? Returns what that adds to the target's prefill
        of `context` tokens per row (seconds, modelled), or None where it does not pay. It pays where the target's
        prefill on its share takes less than on every thread plus the draft's prefill after it: where launches bound
        the forwards (small models, a GPU) the draft's prefill hides for free, but on a CPU that a large prefill
        keeps busy, halving the target's cores costs more than the draft's prefill it hides."""
        on_own_stream = plan.worker == "thread" and self.costs.split is None  # a GPU (workers.thread)
        if plan.mode != "ssd" or not (plan.worker == "process" or on_own_stream):
            return None
        split = self.costs.target(True)(context)
        alone = self.costs.target(False)(context)
        if split >= alone + self.costs.draft(True, plan.int8)(context):
            return None
        return max(0.0, split - alone)
