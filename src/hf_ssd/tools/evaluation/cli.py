"""`hf-ssd eval`: fidelity + acceptance metrics (evaluate modules in hf_ssd.tools.metrics) and HumanEval pass@1, plain
decoding vs SSD, on real prompts with the default pair (or `--tiny` random models for CI), then a verdict.

Verdict PASS when: greedy identity rate is 1.0, the T>0 distribution test does not reject at --alpha, and SSD's
pass@1 equals plain's (greedy outputs are identical, so any difference is a bug). Exit code 0 on PASS, 1 on FAIL.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from hf_ssd.tools import metrics
from hf_ssd.tools.prompts import format_chat, load_prompts
from hf_ssd.tools.evaluation import humaneval
from hf_ssd.testing import tiny_pair, tiny_requested


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="tiny random models (CI); also env HF_SSD_TINY=1")
    p.add_argument("--num-prompts", type=int, default=4, help="HumanEval and MT-Bench prompts each (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="greedy generation length (default 192)")
    p.add_argument("--samples", type=int, default=48, help="T>0 samples per sampler for the distribution test")
    p.add_argument("--sample-tokens", type=int, default=6, help="tokens per sample in the distribution test")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--alpha", type=float, default=0.01, help="level of the distribution test")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--mode", choices=("ssd", "sync"), default="ssd")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HumanEval test program")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the full report as JSON here")


def _load(args):
    if tiny_requested(args.tiny):
        return (*tiny_pair(), "tiny random Llama pair (CI)")
    from hf_ssd.tools.assets import load_default_pair

    target, draft, tok = load_default_pair(torch.float32)
    return target, draft, tok, "Qwen2.5-Coder-1.5B-Instruct / 0.5B-Instruct (fp32)"


def _prompts(args, tiny: bool) -> list[dict]:
    n = args.num_prompts
    rows = []
    for name in ("humaneval", "mtbench"):
        try:
            rows += [dict(r, set=name) for r in load_prompts(name, n=n, seed=args.seed)]
        except FileNotFoundError:
            if not tiny:
                raise
    if tiny and not rows:
        rows = [{"id": f"tiny/{i}", "category": "toy", "prompt": f"def f{i}(x):", "set": "toy"} for i in range(n)]
    if tiny:
        for r in rows:
            r["prompt"] = r["prompt"][:200]  # short contexts keep CI fast
    return rows


def run(args) -> int:
    tiny = tiny_requested(args.tiny)
    target, draft, tok, pair = _load(args)
    ssd = dict(assistant_model=draft, ssd=True, ssd_mode=args.mode, ssd_num_draft_tokens=args.num_draft_tokens)
    rows = _prompts(args, tiny)
    print(f"hf-ssd eval: {pair}; {len(rows)} prompts, mode={args.mode}, K={args.num_draft_tokens}")

    plain_out, ssd_out, stats, t_plain, t_ssd = [], [], [], 0.0, 0.0
    from tqdm.auto import tqdm

    for r in tqdm(rows, desc="plain vs SSD", unit="prompt"):
        ids = tok(format_chat(tok, r["prompt"]), return_tensors="pt")
        P = ids.input_ids.shape[1]
        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        t0 = time.perf_counter()
        a = target.generate(**ids, **gen)
        t1 = time.perf_counter()
        b = target.generate(**ids, **gen, **ssd, return_dict_in_generate=True)
        t2 = time.perf_counter()
        t_plain, t_ssd = t_plain + t1 - t0, t_ssd + t2 - t1
        plain_out.append(a[0, P:].tolist())
        ssd_out.append(b.sequences[0, P:].tolist())
        stats.append(b.ssd_stats)
        same = plain_out[-1] == ssd_out[-1]
        print(f"  {r['id']:<22} plain {t1 - t0:6.1f}s  ssd {t2 - t1:6.1f}s  identical={same}  "
              f"accepted/round={b.ssd_stats['mean_accepted']:.2f} hit_rate={b.ssd_stats['hit_rate']}", flush=True)

    fidelity = metrics.load("ssd_fidelity").compute(predictions=ssd_out, references=plain_out)
    acceptance = metrics.load("ssd_acceptance").compute(**metrics.acceptance_inputs(stats))

    # Distribution test at T > 0: the same prompt repeated as a batch, plain sampling vs SSD sampling.
    ids = tok(format_chat(tok, rows[0]["prompt"]), return_tensors="pt")
    P = ids.input_ids.shape[1]
    batch = {k: v.repeat(args.samples, 1) for k, v in ids.items()}
    gen = dict(max_new_tokens=args.sample_tokens, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(args.seed)
    a = target.generate(**batch, **gen)[:, P:].tolist()
    torch.manual_seed(args.seed + 1)
    b = target.generate(**batch, **gen, **ssd)[:, P:].tolist()
    dist = metrics.load("ssd_fidelity", "distribution").compute(predictions=b, references=a, alpha=args.alpha)

    he_rows = [(i, r) for i, r in enumerate(rows) if r["set"] == "humaneval"]
    he = {"problems": len(he_rows)}
    if he_rows:
        problems = humaneval.problems()
        tasks = [problems[r["id"]] for _, r in he_rows]
        for name, outs in (("plain", plain_out), ("ssd", ssd_out)):
            texts = [humaneval.extract_code(tok.decode(outs[i], skip_special_tokens=True)) for i, _ in he_rows]
            results = humaneval.run_tests(tasks, texts, timeout=args.timeout)
            he[f"pass@1_{name}"] = humaneval.pass_at_1(results)

    checks = {
        "greedy identical": fidelity["identity_rate"] == 1.0,
        # None = not testable (every token too rare for a chi-square bin, or no HumanEval prompt)
        f"distribution test not rejected (alpha={args.alpha})": (not dist["reject"]) if dist["n_tests"] else None,
        "HumanEval pass@1 equal": (he["pass@1_plain"] == he["pass@1_ssd"]) if he_rows else None,
    }
    report = {
        "pair": pair, "mode": args.mode, "num_draft_tokens": args.num_draft_tokens, "prompts": len(rows),
        "fidelity": {k: fidelity[k] for k in ("identity_rate", "mean_matching_prefix")},
        "distribution": {k: dist[k] for k in ("p_value", "min_p_value", "n_tests", "reject")},
        "acceptance": {k: acceptance[k] for k in ("mean_accepted", "mean_tokens_per_round", "hit_rate")},
        "humaneval": he, "time_plain_s": round(t_plain, 2), "time_ssd_s": round(t_ssd, 2),
        "speedup": round(t_plain / t_ssd, 3) if t_ssd else None, "checks": checks,
        "verdict": "FAIL" if False in checks.values() else "PASS",
    }
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}, indent=1))
    for name, ok in checks.items():
        print(f"  [{'skipped' if ok is None else 'ok' if ok else 'FAIL'}] {name}")
    print(f"verdict: {report['verdict']}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["verdict"] == "PASS" else 1
