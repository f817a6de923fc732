"""Plain words about what a machine can sustain for a model pair, read off the measured costs (`hf-ssd doctor`)."""
from __future__ import annotations

from hf_ssd.control.controller import Controller
from hf_ssd.control.costs import Costs


def largest_hidden_budget(costs: Costs, K: int, split: bool, int8: bool = False, cap: int = 256) -> int:
    """The most branches per row whose tree (glue + K steps) still fits in one verify of K+1 tokens; 0 if even the
    glue does not."""
    verify, draft = costs.target(split)(K + 1), costs.draft(split, int8)
    best = 0
    for n in range(1, cap + 1):
        if draft(K + 1) + K * draft(n) > verify:
            break
        best = n
    return best


def diagnose(costs: Costs, controller: Controller, K: int = 4) -> list[str]:
    """Sentences, one finding each, ending with the controller's choice."""
    split = costs.split is not None
    t_all, d_all = costs.target(False), costs.draft(False, False)
    lines = [
        f"The target takes {t_all(1) * 1e3:.1f} ms for one token per row (batch {costs.batch}): plain decoding runs at "
        f"about {costs.batch / costs.plain_step():.2f} tok/s here.",
        f"A verify of K+1={K + 1} tokens costs {t_all(K + 1) / t_all(1):.2f} target steps; a draft step costs "
        f"{d_all(1) / t_all(1):.2f} of one, so synchronous SD with K={K} spends {K * d_all(1) / t_all(K + 1):.2f} "
        "verifies drafting per round.",
    ]
    if costs.draft_int8_all is not None:
        q1 = costs.draft_int8_all(1)
        lines.append(f"The int8 copy of the draft runs a step in {q1 * 1e3:.1f} ms against "
                     f"{d_all(1) * 1e3:.1f} ms in full precision ({d_all(1) / max(q1, 1e-9):.1f}x).")
    if split:
        tt, dt = costs.split
        lines.append(f"With the draft beside the target, the cores split {tt}+{dt}: a verify then takes "
                     f"{costs.target(True)(K + 1) * 1e3:.1f} ms instead of {t_all(K + 1) * 1e3:.1f} ms.")
    else:
        lines.append("There is no spare core (or a GPU shares one device): the draft's tree competes with the verify.")
    lines.append(f"Run in two threads, {costs.overlap:.0%} of the shorter side hides under the longer one (Python work "
                 "holds the GIL; small, launch-bound models overlap least, and so do memory-bound ones that share "
                 "the memory bus).")
    draft = costs.draft(split, False)
    tree32 = draft(K + 1) + K * draft(32)
    hidden = largest_hidden_budget(costs, K, split)
    lines.append(f"A tree of 32 branches costs {tree32 / costs.target(split)(K + 1):.2f} verifies here: "
                 f"budget {hidden} is the most that hides entirely under one verify at K={K}.")
    if hidden < 2:
        lines.append("The speculation cache cannot hide here: SSD would only add work to synchronous SD.")
    decision = controller.decide()
    lines.append(f"Choice: {decision.reason}.")
    process = controller.process_option(decision.chosen)
    if process is not None:
        lines.append(f"A kept draft process would do better: {process.plan.label} is predicted "
                     f"{process.tokens_per_s:.2f} tok/s. generate(..., ssd=True) starts one once its calls here have "
                     "run long enough to repay the start (unless HF_SSD_AUTO_PROCESS=0 or the main script runs code "
                     "at import).")
    return lines
