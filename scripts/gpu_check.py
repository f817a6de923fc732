"""GPU check: exactness on CUDA plus a short overlap measurement with the draft on its own stream.

    python scripts/gpu_check.py            # on a machine with a CUDA GPU; prints a JSON summary
    python scripts/gpu_check.py --cpu      # the same checks on the CPU (a dry run of this script)

Models are random weights in real shapes built from configs (Qwen2.5 1.5B-like target, 0.5B-like draft; the
draft shares the target's first layers so it agrees often), since pretrained weights cannot travel to the GPU box.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import hf_ssd  # noqa: F401


def build_pair(device: str, dtype: torch.dtype, small: bool):
    torch.manual_seed(0)
    if small:
        cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          initializer_range=0.2)
        draft_layers = 2
    else:  # Qwen2.5-1.5B shapes (target) and a 6-layer draft sharing its first layers
        cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096)
        draft_layers = 6
    target = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    draft_cfg = Qwen2Config(**{**cfg.to_dict(), "num_hidden_layers": draft_layers, "layer_types": None})
    draft = Qwen2ForCausalLM(draft_cfg).to(device=device, dtype=dtype).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}, strict=False)
    return target, draft


def exactness(device: str) -> dict:
    target, draft = build_pair(device, torch.float32, small=True)
    ids = torch.randint(0, 512, (3, 12), device=device, generator=torch.Generator(device).manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    out = {}
    for worker in ("inline", "thread"):
        for mode in ("sync", "ssd"):
            if mode == "sync" and worker != "inline":
                continue  # synchronous SD drafts inline (ssd_worker applies to ssd_mode="ssd")
            got = target.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, assistant_model=draft,
                                  ssd=True, ssd_mode=mode, ssd_worker=worker, ssd_budget=8)
            out[f"greedy_{mode}_{worker}"] = bool(torch.equal(got, ref))
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.8, assistant_model=draft, ssd=True,
              ssd_budget=8, ssd_downweight=0.5)
    a = target.generate(ids, generator=torch.Generator(device).manual_seed(3), ssd_worker="inline", **kw)
    b = target.generate(ids, generator=torch.Generator(device).manual_seed(3), ssd_worker="thread", **kw)
    out["seeded_sampling_thread_equals_inline"] = bool(torch.equal(a, b))
    return out


def overlap(device: str, small: bool, new_tokens: int) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, draft = build_pair(device, dtype, small)
    ids = torch.randint(0, 500, (1, 128), device=device)
    results = {}
    for name, kw in (("plain", {}),
                     ("sd", dict(assistant_model=draft, ssd=True, ssd_mode="sync")),
                     ("ssd_inline", dict(assistant_model=draft, ssd=True, ssd_worker="inline")),
                     ("ssd_thread", dict(assistant_model=draft, ssd=True, ssd_worker="thread"))):
        target.generate(ids, max_new_tokens=4, do_sample=False, **kw)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - start
        stats = getattr(out, "ssd_stats", None) or {}
        results[name] = {"tok_s": round((out.sequences.shape[1] - ids.shape[1]) / secs, 2),
                         "hit_rate": stats.get("hit_rate"), "overlap_fraction": stats.get("overlap_fraction"),
                         "phase_means_s": stats.get("phase_means_s")}
    plain = results["plain"]["tok_s"]
    for r in results.values():
        r["speedup_vs_plain"] = round(r["tok_s"] / plain, 3)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (dry run)")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing run (use --cpu for a dry run on the CPU)", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "exactness": exactness(device)}
    summary["overlap"] = overlap(device, small=args.cpu, new_tokens=args.new_tokens if not args.cpu else 24)
    print(json.dumps(summary, indent=2))
    return 0 if all(summary["exactness"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
