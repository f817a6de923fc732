"""What `ssd=True` chooses call by call, as a user's program would see it: no bench warm-up, no hand-picked rows
beside it. Overhead workload, compiled (`ssd_compile` + `ssd_compile_target`), batch 1, greedy, the draft's kept
process started up front as a server would (`hf_ssd.warmup(draft_process=True)`), a first 8-token call (a
server's warm-up), then full-length calls over the prompts in turn.

    .venv/bin/python scripts/controller_calls.py --alpha-noise 0 --calls 16

Prints per call: its speed end to end, seconds it compiled in the draft process, the plan it ran (and switches),
the start of its reason, and the start-price ratios the controller has learned per plan family (measured / modelled
seconds of a drafter's start, `Memory.startup`). Session 37 found with it that one cold start priced every later
drafting call out (docs/benchmark-history.md). Takes minutes on a 2-core CPU: each new plan shape compiles.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alpha-noise", type=float, default=0.0, help="0: α = 1; 0.014: α ≈ 0.7")
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=6, help="HumanEval prompts, used in turn")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="as the bench caps them")
    ap.add_argument("--reason-chars", type=int, default=160, help="how much of each call's reason to print")
    ap.add_argument("--table", action="store_true", help="print each call's best few plans as its decision priced them")
    ap.add_argument("--caches", action="store_true", help="print the in-process static caches after each call")
    ap.add_argument("--families", type=int, default=0, metavar="N",
                    help="after each call, price every plan as a call's start would (on this call's prompt) and "
                         "print each drafting family's N fastest, with their round's parts and start")
    args = ap.parse_args()

    import hf_ssd
    from hf_ssd.control import memory as memory_mod
    from hf_ssd.runtime import static_registry
    from hf_ssd.tools.bench.overhead import overhead_pair
    from hf_ssd.tools.prompts import format_chat, load_prompts

    from hf_ssd.control.controller import Controller
    from hf_ssd.control.decision import family

    last = {}  # the controller of the latest decision, to price every plan after the call
    decide = Controller.decide

    def remembering(self, *a, **kw):
        last["controller"] = self
        return decide(self, *a, **kw)

    Controller.decide = remembering
    target, draft, tok = overhead_pair(args.alpha_noise)
    print("warmup:", hf_ssd.warmup(target, draft, draft_process=True, progress=False).get("draft_process"))
    prompts = [torch.tensor([tok.encode(format_chat(tok, r["prompt"]))[-args.max_prompt_tokens:]])
               for r in load_prompts("humaneval", args.prompts, seed=0, max_chars=4000)]
    kw = dict(assistant_model=draft, ssd=True, ssd_compile=True, ssd_compile_target=True, do_sample=False,
              return_dict_in_generate=True)
    compiled_before = static_registry.COMPILE_SPENT["seconds"]
    for call in range(args.calls):
        ids = prompts[call % len(prompts)]
        new = 8 if call == 0 else args.max_new_tokens
        t0 = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **kw)
        seconds = time.perf_counter() - t0
        stats = out.ssd_stats
        control = stats.get("controller") or {}
        starts = {fam: None if e.value is None else round(e.value, 2)
                  for m in memory_mod._MEMORY.values() for fam, e in m.startup.items()}
        # the in-process static caches: which one compiled what (a draft process's are its own)
        caches = {name: [(e.max_cache_len, sorted(e.compiled_widths), round(e.compile_s, 1))
                         for e in static_registry.registry_entries(model)]
                  for name, model in (("target", target), ("draft", draft))}
        spent = static_registry.COMPILE_SPENT["seconds"] - compiled_before
        compiled_before = static_registry.COMPILE_SPENT["seconds"]
        print(f"call {call:2d}: {new / seconds:7.1f} tok/s e2e, compiled {stats.get('draft_compile_s') or 0:.1f} s "
              f"(in this process {spent:.1f} s) | "
              f"{control.get('choice')} ({len(control.get('switches') or [])} switches) | "
              f"{str(control.get('reason'))[:args.reason_chars]} | start ratios {starts}", flush=True)
        if args.table:  # the call's first decision: its best few plans, as priced
            rows = [f"{r['plan']}: {r['tok_s']:.0f}" + (f" ({r['call_tok_s']:.0f} over the call)" if "call_tok_s" in r
                                                        else "") + (f" +{r['compile_s']:.1f} s compile"
                                                                    if "compile_s" in r else "")
                    for r in control.get("predicted") or []]
            print(f"         predicted: {'; '.join(rows)}", flush=True)
        if args.families and "controller" in last:
            ctl = last["controller"]
            preds = sorted((ctl.predict(p, aged=True) for p in ctl.plans), key=lambda x: -x.tokens_per_s)
            horizon = ctl.horizon(args.max_new_tokens, ids.shape[1])
            for x in preds:
                ctl._price_call(x, horizon, None)
            listed = ctl.memory.shortlist.plans if ctl.memory.shortlist is not None else ()
            for fam in sorted({family(p.plan) for p in preds} - {"plain"}):
                rows = [f"{x.plan.label}{'' if ctl.measured(x.plan) else ' (untried)'}"
                        f"{'' if x.plan in listed else ' (not shortlisted)'}: {x.tokens_per_s:.0f}, "
                        f"{x.call_tokens_per_s:.0f} over a call ("
                        f"{', '.join(f'{k} {v * 1e3:.1f}' for k, v in x.parts.items())}, "
                        f"start {x.startup_s * 1e3:.1f} ms)"
                        for x in [x for x in preds if family(x.plan) == fam][:args.families]]
                print(f"         {fam}: {'; '.join(rows)}", flush=True)
        if args.caches:
            print(f"         static caches (slots, compiled widths, compile s): {caches}", flush=True)


if __name__ == "__main__":  # the kept draft process is spawned: it imports this file again
    main()
