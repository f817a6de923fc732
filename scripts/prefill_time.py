"""What a batch's prompt prefill costs, padded and grouped (runtime/prefill.py), on the overhead workload's target
and draft, with the dynamic and the static cache.

    .venv/bin/python scripts/prefill_time.py --prompt-set mtbench --batch-sizes 4,16

The bench's prompts (chat template, the last 512 tokens), left-padded in batches; each batch prefilled `--repeats`
times each way on a fresh cache. Prints the median milliseconds per batch and how many groups the rows formed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(map(len, rows))
    ids = torch.tensor([[pad] * (n - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def main() -> None:
    from hf_ssd.runtime.kv import CachedModel
    from hf_ssd.runtime.prefill import forward_tokens, padding_groups, prefill_prompt
    from hf_ssd.runtime.static_kv import StaticCachedModel
    from hf_ssd.tools.bench.overhead import overhead_pair
    from hf_ssd.tools.prompts import format_chat, load_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-set", default="mtbench")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch-sizes", default="4,16")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = overhead_pair(0.014)
    ds = load_prompts(args.prompt_set, args.prompts, seed=0, max_chars=4000)
    rows = [tok.encode(format_chat(tok, r["prompt"]))[-args.max_prompt_tokens:] for r in ds]
    for B in (int(b) for b in args.batch_sizes.split(",")):
        batches = [left_padded(rows[i:i + B], tok.pad_token_id) for i in range(0, len(rows), B)]
        groups = [len(padding_groups(m[:, :-1].bool(), forward_tokens(torch.device("cpu"))) or [1]) for _, m in batches]
        print(f"batch {B}: groups per batch {groups}")
        for model, name in ((target, "target"), (draft, "draft")):
            for static in (False, True):
                ms = {}
                for grouped in (False, True):
                    seconds = []
                    for _ in range(args.repeats):
                        for ids, mask in batches:
                            kv = StaticCachedModel(model, B, 1024) if static else CachedModel(model, B)
                            began = time.perf_counter()
                            with torch.inference_mode():
                                if grouped:
                                    prefill_prompt(kv, ids, mask)
                                else:
                                    pos = (mask.cumsum(1) - 1).clamp_min(0)
                                    kv.forward(ids[:, :-1], pos[:, :-1], mask[:, :-1].bool(), prefill=True)
                            seconds.append(time.perf_counter() - began)
                            if static:
                                kv.release()
                    ms[grouped] = 1000 * statistics.median(seconds)
                cache = "static" if static else "dynamic"
                print(f"  {name:6s} {cache:7s} padded {ms[False]:7.1f} ms, grouped {ms[True]:7.1f} ms "
                      f"({ms[False] / ms[True]:.2f}x)")


if __name__ == "__main__":
    main()
