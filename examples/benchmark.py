"""Benchmark: plain vs synchronous SD vs SSD on a few prompts, tokens/s and acceptance (for the full, recorded
benchmark use `hf-ssd bench`, which writes JSON + plots to benchmarks/)."""
import time

from _common import encode, load, parser

p = parser(__doc__)
p.add_argument("--prompts", type=int, default=2)
args = p.parse_args()
target, draft, tok, n = load(args)
prompts = ["Write a function to merge two sorted lists.", "List the planets of the solar system.",
           "Implement binary search in Python.", "Describe the water cycle."][: args.prompts]
methods = {"plain": {}, "sd (sync)": dict(assistant_model=draft, ssd=True, ssd_mode="sync"),
           "ssd": dict(assistant_model=draft, ssd=True, ssd_mode="ssd")}
target.generate(**encode(tok, prompts[0]), max_new_tokens=2, do_sample=False)  # warm-up
for name, extra in methods.items():
    tokens, seconds, acc = 0, 0.0, []
    for prompt in prompts:
        inputs = encode(tok, prompt)
        t0 = time.perf_counter()
        out = target.generate(**inputs, max_new_tokens=n, do_sample=False, return_dict_in_generate=True, **extra)
        seconds += time.perf_counter() - t0
        tokens += out.sequences.shape[1] - inputs.input_ids.shape[1]
        if getattr(out, "ssd_stats", None):
            acc.append(out.ssd_stats["mean_accepted"])
    extra_info = f"  accepted/round {sum(acc) / len(acc):.2f}" if acc else ""
    print(f"{name:>10}: {tokens / seconds:7.1f} tok/s{extra_info}")
