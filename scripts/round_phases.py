"""Where a round's time goes: hand-picked SD and SSD plans on the overhead workload, with the engine's per-round
phases (verify, tree or draft steps, resolve, hand-over, host work), tokens per round and hit rate.

    .venv/bin/python scripts/round_phases.py --alpha-noise 0 --plans sd:8,ssd:4:2,ssd:4:8
    .venv/bin/python scripts/round_phases.py --alpha-noise 0.014 --plans sd:2,sd:3,ssd:3:8,ssd:3:16

A plan is `sd:K` or `ssd:K:budget`. Each plan runs every prompt `--repeats` times on one kept draft process (the
first pass is a warm-up: it compiles), the target on one thread and the draft on another (the bench's paper
setting). Prints one line per plan: the median call's wall time and the medians of each phase over the timed calls.
What the ceiling table of `hf-ssd simulate` leaves out (tree width, hand-over, lookup) shows up here.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm


def parse_plan(text: str) -> tuple[str, int, int | None]:
    parts = text.split(":")
    if parts[0] == "sd" and len(parts) == 2:
        return "sync", int(parts[1]), None
    if parts[0] == "ssd" and len(parts) == 3:
        return "ssd", int(parts[1]), int(parts[2])
    raise ValueError(f"a plan is sd:K or ssd:K:budget, got {text!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alpha-noise", type=float, default=0.0)
    ap.add_argument("--plans", default="sd:8,ssd:4:2,ssd:4:8")
    ap.add_argument("--prompts", type=int, default=3, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="passes over the prompts; the first is not timed")
    ap.add_argument("--worker", default="process", choices=("process", "thread", "inline"))
    ap.add_argument("--eager", action="store_true", help="no static caches or compiled forwards")
    args = ap.parse_args()
    plans = [parse_plan(p) for p in args.plans.split(",")]
    torch.set_num_threads(1)

    import hf_ssd
    from hf_ssd.tools.bench.overhead import overhead_pair
    from hf_ssd.tools.prompts import load_prompts

    target, draft, tok = overhead_pair(args.alpha_noise)
    prompts = [tok(r["prompt"], return_tensors="pt").input_ids for r in load_prompts("humaneval", args.prompts)]
    process = hf_ssd.DraftProcess(draft) if args.worker == "process" else None
    try:
        for mode, K, budget in plans:
            kw = dict(assistant_model=draft, ssd=True, ssd_mode=mode, ssd_num_draft_tokens=K, ssd_draft_quantize=None,
                      max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
            if mode == "ssd":
                kw.update(ssd_worker=process or args.worker, ssd_budget=budget)
                if args.worker != "inline":
                    kw.update(ssd_target_threads=1, ssd_draft_threads=1)
            if not args.eager:
                kw.update(ssd_compile=True, ssd_compile_target=True)
            walls, stats = [], []
            label = f"{'sd' if mode == 'sync' else 'ssd'} K={K}" + (f" budget={budget}" if budget else "")
            for rep in tqdm(range(args.repeats), desc=label, leave=False):
                for ids in prompts:
                    with torch.inference_mode():
                        began = time.perf_counter()
                        out = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                    if rep > 0:
                        walls.append(time.perf_counter() - began)
                        stats.append(out.ssd_stats)
            phases = {k: statistics.median(s["phase_means_s"][k] for s in stats if k in s["phase_means_s"])
                      for k in stats[0]["phase_means_s"]}
            hits = [s["hit_rate"] for s in stats if s.get("hit_rate") is not None]
            print(f"{label}: call {statistics.median(walls):.3f} s, "
                  f"{statistics.median(s['mean_tokens_per_round'] for s in stats):.2f} tokens/round"
                  + (f", hit {statistics.median(hits):.0%}" if hits else "") + ", "
                  + ", ".join(f"{k} {1000 * v:.2f} ms" for k, v in phases.items()), flush=True)
    finally:
        if process is not None:
            process.close()


if __name__ == "__main__":
    main()
