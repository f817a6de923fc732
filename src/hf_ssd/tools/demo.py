"""`hf-ssd demo`: one real prompt through the default pair: `generate(..., ssd=True)` with no options writes a
complete answer, and plain decoding and synchronous SD are timed on its first tokens, in the same run; the answer's
own speed is read both over those first tokens (the like-for-like comparison) and over all of it."""
from __future__ import annotations

import argparse
import time

import torch

from hf_ssd.tools.token_clock import TokenClock

DEFAULT_PROMPT_ID = "HumanEval/2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help="your own prompt (default: a HumanEval problem)")
    p.add_argument("--max-new-tokens", type=int, default=320, help="the answer's limit (it ends at EOS before)")
    p.add_argument("--baseline-tokens", type=int, default=64,
                   help="tokens that plain decoding and synchronous SD generate for the comparison")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    import hf_ssd  # noqa: F401  (enables ssd=True)
    from hf_ssd.tools.assets import load_default_pair
    from hf_ssd.tools.prompts import format_chat, load_prompts

    dtype = getattr(torch, args.dtype)
    print(f"loading the default pair ({args.dtype}) ...", flush=True)
    target, draft, tokenizer = load_default_pair(dtype=dtype)
    if args.prompt is None:
        prompt = next(r for r in load_prompts("humaneval") if r["id"] == DEFAULT_PROMPT_ID)["prompt"]
    else:
        prompt = args.prompt
    enc = tokenizer(format_chat(tokenizer, prompt), return_tensors="pt")
    ids, P = enc.input_ids, enc.input_ids.shape[1]
    common = dict(attention_mask=enc.attention_mask, do_sample=False)
    ssd = dict(assistant_model=draft, ssd=True, return_dict_in_generate=True)

    print("warming up (the controller measures the pair once per process) ...", flush=True)
    target.generate(ids, **common, max_new_tokens=4)
    target.generate(ids, **common, **ssd, max_new_tokens=12)

    print(f"SSD, no options: up to {args.max_new_tokens} new tokens ...", flush=True)
    clock = TokenClock()
    clock.start()
    answer, t_ssd = _timed(lambda: target.generate(ids, **common, **ssd, streamer=clock,
                                                   max_new_tokens=args.max_new_tokens))
    n_ssd = answer.sequences.shape[1] - P
    n_base = min(args.baseline_tokens, n_ssd)
    print(f"plain decoding and synchronous SD: {n_base} new tokens each ...", flush=True)
    plain, t_plain = _timed(lambda: target.generate(ids, **common, max_new_tokens=n_base))
    sd, t_sd = _timed(lambda: target.generate(ids, **common, **ssd, ssd_mode="sync", max_new_tokens=n_base))

    print("\n" + tokenizer.decode(answer.sequences[0, P:], skip_special_tokens=True))
    ended = "ended at EOS" if n_ssd < args.max_new_tokens else "hit --max-new-tokens"
    print(f"\n({n_ssd} tokens, {ended})")
    rate = {"plain": n_base / t_plain, "sync": n_base / t_sd, "ssd": n_base / clock.seconds_to(n_base),
            "ssd_all": n_ssd / t_ssd}
    same = {"plain": True, "sync": torch.equal(sd.sequences, plain),
            "ssd": torch.equal(answer.sequences[:, : P + n_base], plain)}
    same["ssd_all"] = same["ssd"]
    print("\n| method | new tokens | tokens/s | x plain | x synchronous SD | identical to plain |\n"
          "|---|---|---|---|---|---|")
    for name, label, n in (("plain", "plain generate()", n_base), ("sync", "synchronous SD", n_base),
                           ("ssd", "ssd=True (no options), its first tokens", n_base),
                           ("ssd_all", "ssd=True (no options), the whole answer", n_ssd)):
        print(f"| {label} | {n} | {rate[name]:.2f} | {rate[name] / rate['plain']:.2f}x | "
              f"{rate[name] / rate['sync']:.2f}x | {same[name]} |")
    s = answer.ssd_stats
    c = s.get("controller") or {}
    print(f"\nController: ran {c.get('choice', s['mode'])}. Why: {c.get('reason', 'options given explicitly')}.")
    for sw in c.get("switches", []):
        print(f"  round {sw['round']}: {sw['from']} -> {sw['to']} ({sw['reason']})")
    if "process_worker" in c:
        print(f"Process worker: {c['process_worker']}.")
    measured = c.get("plain_alpha") or {}
    if "alpha" in measured:
        print(f"Acceptance measured along the plain answer (for the next calls): alpha={measured['alpha']} over "
              f"{measured['positions']} tokens in {measured['seconds']} s.")
    hit = "n/a" if s["hit_rate"] is None else f"{s['hit_rate']:.0%}"
    hidden = "n/a" if s["overlap_fraction"] is None else f"{s['overlap_fraction']:.0%}"
    print(f"Mean accepted drafts per round {s['mean_accepted']:.2f}, cache hit rate {hit}, draft work hidden under "
          f"the verify {hidden}. (Every rate includes the call's prefill; the answer's first {n_base} tokens are "
          "timed by a streamer as they arrive.)")
    return 0
