"""Time one layer's masked attention over a static cache, compiled, as transformers' SDPA runs it (K and V copied to
every query head: `repeat_kv`) and packed (runtime/packed_attention.py), at the overhead workload's shapes and the
1.5B target's. Writes JSON.

    python scripts/attention_copy.py --json benchmarks/attention_copy.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_ssd.runtime.packed_attention import packed_sdpa

SHAPES = [  # (label, batch, heads, KV heads, head dim, slots, queries per row)
    ("overhead, batch 1, step of 2", 1, 4, 2, 16, 1024, 2),
    ("overhead, batch 1, verify of 5", 1, 4, 2, 16, 1024, 5),
    ("overhead, batch 16, step of 2", 16, 4, 2, 16, 1024, 2),
    ("overhead, batch 16, verify of 5", 16, 4, 2, 16, 1024, 5),
    ("1.5B shape, batch 1, verify of 5", 1, 12, 2, 128, 1024, 5),
    ("1.5B shape, batch 16, step of 2", 16, 12, 2, 128, 1024, 2),
]


class _Heads(torch.nn.Module):
    """What the attention functions read off an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _time(fn, args, calls: int) -> float:
    for _ in range(3):
        fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for label, B, H, KV, D, M, n in SHAPES:
        module = _Heads(H // KV)
        q, k, v = torch.randn(B, H, n, D), torch.randn(B, KV, M, D), torch.randn(B, KV, M, D)
        mask = torch.zeros(B, 1, n, M)
        mask[..., M // 2:] = torch.finfo(torch.float32).min  # half the slots in use
        row = {"shape": label, "batch": B, "heads": H, "kv_heads": KV, "head_dim": D, "slots": M, "queries": n}
        outputs = {}
        for name, attention in (("copied_ms", sdpa_attention_forward), ("packed_ms", packed_sdpa)):
            torch._dynamo.reset()  # one lambda code object for every shape: start each from no graphs
            compiled = torch.compile(lambda *a, f=attention: f(module, *a)[0], fullgraph=True, dynamic=False)
            outputs[name] = compiled(q, k, v, mask)
            row[name] = round(_time(compiled, (q, k, v, mask), args.calls) * 1e3, 3)
        row["max_abs_diff"] = float((outputs["copied_ms"] - outputs["packed_ms"]).abs().max())
        rows.append(row)
        print(f"{label}: copied {row['copied_ms']} ms, packed {row['packed_ms']} ms, "
              f"max |diff| {row['max_abs_diff']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python scripts/attention_copy.py --json " + args.json, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
