"""Where a call that decodes plain runs: handed off to transformers' loop (plain generate() itself), or in our loop
from the call's start (our grouped prefill, then one-token rounds; on a compiled target its compiled one-token
graph). A call's start ranks plain by the faster of the two; a part of the Controller's decision.

transformers' loop prefills the padded batch in one forward; ours prefills rows of similar length together
(runtime.prefill). At batch 16 on the default pair a padded prefill of 16 MT-Bench prompts took 81-86 s against
22-25 s in our loop, and `ssd=True`, on synchronous SD to avoid it, ran at 0.96x plain decoding; on the compiled
overhead workload 0.6-0.7 s against 0.1 s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hf_ssd.control.decision import Decision, Horizon
from hf_ssd.control.plan import Prediction

if TYPE_CHECKING:
    from hf_ssd.control.controller import Controller

# A call that decodes plain hands off to transformers' loop unless plain steps in our loop are predicted this much
# faster over the call: they skip most of a padded batch's prefill but add our per-round work, which the price knows
# only once such steps have run (Memory.in_loop_plain).
IN_LOOP_GAIN = 1.03


def plain_in_loop(ctl: Controller, handed_off: Prediction, horizon: Horizon) -> Prediction:
    """Plain decoding in our loop from the call's start, priced over the call (`handed_off`: plain in transformers'
    loop, priced over it): our loop's steps (Controller.predict in_loop), the prefill on our loop's path and the
    one-token graph it may compile."""
    plan = handed_off.plan
    pred = ctl.predict(plan, aged=True, in_loop=True)
    pred.horizon = horizon.tokens * ctl.batch
    prefill = ctl.target_prefill_s(plan, horizon.context, horizon.prefill_share, in_loop=True)
    compiling = ctl.compile_s(plan, horizon, in_loop=True)
    pred.startup_s = prefill + compiling
    pred.parts = {**pred.parts, "prefill": prefill, **({"compile": compiling} if compiling > 0 else {})}
    return pred


def faster_plain_loop(ctl: Controller, preds: list[Prediction], horizon: Horizon
                      ) -> tuple[list[Prediction], Prediction | None]:
    """`preds` (priced over the call) with plain's prediction replaced by our loop's where that is IN_LOOP_GAIN
    faster than the hand-off, and that prediction (None where plain stays handed off; its record then keeps what
    our loop was priced at)."""
    handed_off = next((p for p in preds if p.plan.mode == "plain"), None)
    if handed_off is None:
        return preds, None
    loop = plain_in_loop(ctl, handed_off, horizon)
    if loop.call_tokens_per_s < IN_LOOP_GAIN * handed_off.call_tokens_per_s:
        handed_off.parts = {**handed_off.parts, "in_our_loop_call_tok_s": loop.call_tokens_per_s,
                            "in_our_loop_round_s": loop.round_s,
                            "in_our_loop_compile_s": loop.parts.get("compile", 0.0)}
        return preds, None
    loop.parts["handed_off_call_tok_s"] = handed_off.call_tokens_per_s
    return [loop if p is handed_off else p for p in preds], loop


def in_our_loop(decision: Decision, loop: Prediction) -> Decision:
    """`decision`, run in our loop where it is plain decoding ranked by our loop's price (`loop`), and not a look at
    plain run to measure the hand-off (an exploration)."""
    if decision.plan.mode != "plain" or decision.choice is not None:
        return decision
    decision.in_loop = True
    decision.reason = (f"plain in our loop: {loop.call_tokens_per_s:.2f} tok/s over this call with its prefill "
                       f"({loop.startup_s:.1f} s), against {loop.parts['handed_off_call_tok_s']:.2f} handed off to "
                       f"transformers' loop; {decision.reason}")
    return decision
