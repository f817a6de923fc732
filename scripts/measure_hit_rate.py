"""Greedy speculation-cache hit rate of SSD on the default pair (fp32), a few HumanEval prompts.

    .venv/bin/python scripts/measure_hit_rate.py --prompts 3 --max-new-tokens 64 --budgets 4,8,16 --K 4
Prints one line per budget and checks every output against plain greedy decoding.
"""
from __future__ import annotations

import argparse
import json

import torch
from tqdm import tqdm

import hf_ssd  # noqa: F401
from hf_ssd.tools.assets import load_default_pair
from hf_ssd.tools.prompts import format_chat, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="4,8,16")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = load_default_pair(dtype=torch.float32)
    prompts = load_prompts("humaneval", n=args.prompts)
    results = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        lookups = hits = 0
        identical = True
        accepted = []
        for row in tqdm(prompts, desc=f"budget {budget}"):
            enc = tok(format_chat(tok, row["prompt"]), return_tensors="pt")
            kw = dict(attention_mask=enc.attention_mask, max_new_tokens=args.max_new_tokens, do_sample=False)
            plain = target.generate(enc.input_ids, **kw)
            out = target.generate(enc.input_ids, **kw, assistant_model=draft, ssd=True, ssd_worker="inline",
                                  ssd_num_draft_tokens=args.K, ssd_budget=budget, return_dict_in_generate=True)
            s = out.ssd_stats
            lookups += s["cache_lookups"]
            hits += s["cache_hits"]
            accepted.append(s["mean_accepted"])
            identical &= torch.equal(out.sequences, plain)
        res = {"K": args.K, "budget": budget, "prompts": len(prompts), "lookups": lookups, "hits": hits,
               "hit_rate": hits / max(lookups, 1), "mean_accepted": sum(accepted) / len(accepted),
               "identical_to_plain": bool(identical), "fanout_after_hit": s["fanout_after_hit"]}
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
