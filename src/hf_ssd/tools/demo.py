"""`hf-ssd demo`: one real prompt through the default pair, plain vs synchronous SD vs SSD, measured in one run."""
from __future__ import annotations

import argparse
import time

import torch

DEFAULT_PROMPT_ID = "HumanEval/2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="default", help="model pair from hf_ssd.tools.assets.PAIRS")
    p.add_argument("--prompt", default=None, help="your own prompt (default: a HumanEval problem)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--K", type=int, default=2, help="drafts per round (2 suits this 2-core CPU; see benchmarks/)")
    p.add_argument("--draft-quantize", default="int8", choices=["int8", "none"],
                   help="int8 copy of the draft for SD and SSD (CPU; exact either way)")
    p.add_argument("--budget", type=int, default=None, help="speculation cache branches per row (default: measured)")
    p.add_argument("--worker", default="auto", help="inline | thread | process | auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the target (and for the draft in SSD)")


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    import hf_ssd  # noqa: F401  (enables ssd=True)
    from hf_ssd.tools.assets import load_default_pair
    from hf_ssd.tools.prompts import format_chat, load_prompts

    dtype = getattr(torch, args.dtype)
    print(f"loading the {args.pair} pair ({args.dtype}) ...", flush=True)
    target, draft, tokenizer = load_default_pair(dtype=dtype)
    if args.prompt is None:
        problems = load_prompts("humaneval")
        row = next(r for r in problems if r["id"] == DEFAULT_PROMPT_ID)
        prompt = row["prompt"]
    else:
        prompt = args.prompt
    text = format_chat(tokenizer, prompt)
    enc = tokenizer(text, return_tensors="pt")
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, attention_mask=enc.attention_mask)
    torch.set_num_threads(args.threads)
    quantize = None if args.draft_quantize == "none" else args.draft_quantize
    ssd_common = dict(assistant_model=draft, ssd=True, ssd_num_draft_tokens=args.K, ssd_target_threads=args.threads,
                      ssd_draft_threads=args.threads, ssd_draft_quantize=quantize, return_dict_in_generate=True)
    print("warming up (int8 draft copy, cache-budget measurement, worker thread) ...", flush=True)
    warm = dict(common, max_new_tokens=4)
    target.generate(enc.input_ids, **warm)
    target.generate(enc.input_ids, **warm, **ssd_common, ssd_mode="ssd", ssd_worker=args.worker, ssd_budget=args.budget)

    plain, t_plain = _timed(lambda: target.generate(enc.input_ids, **common))
    sd, t_sd = _timed(lambda: target.generate(enc.input_ids, **common, **ssd_common, ssd_mode="sync"))
    ssd, t_ssd = _timed(lambda: target.generate(
        enc.input_ids, **common, **ssd_common, ssd_mode="ssd", ssd_worker=args.worker, ssd_budget=args.budget))

    n_new = plain.shape[1] - enc.input_ids.shape[1]
    print("\n" + tokenizer.decode(ssd.sequences[0, enc.input_ids.shape[1]:], skip_special_tokens=True))
    print("\n| method | tokens/s | speedup | mean accepted / round | hit rate | identical to plain |")
    print("|---|---|---|---|---|---|")
    for name, out, secs in (("plain", None, t_plain), ("speculative (sync SD)", sd, t_sd), ("SSD (Saguaro)", ssd, t_ssd)):
        seq = plain if out is None else out.sequences
        tokens = seq.shape[1] - enc.input_ids.shape[1]
        stats = {} if out is None else out.ssd_stats
        acc = f"{stats['mean_accepted']:.2f}" if stats else "-"
        hit = f"{stats['hit_rate']:.0%}" if stats.get("hit_rate") is not None else "-"
        same = torch.equal(seq, plain)
        print(f"| {name} | {tokens / secs:.2f} | {t_plain / secs * tokens / n_new:.2f}x | {acc} | {hit} | {same} |")
    s = ssd.ssd_stats
    hidden = "n/a" if s["overlap_fraction"] is None else f"{s['overlap_fraction']:.0%}"
    print(f"\nSSD: worker={s['worker']}, K={args.K}, draft={quantize or 'as loaded'}, budget={s['budget']}, fan-out "
          f"after a hit={s['fanout_after_hit']}, draft work hidden under verify={hidden}, "
          f"mean seconds per round={s['phase_means_s']}")
    return 0
