"""`hf-ssd tune` and `hf-ssd doctor`: measure a model pair on this machine.

doctor: the cost probe, in plain words, and what the controller would choose.
tune:   also times real generations of the controller's best plans of each mode (plain, sync SD, SSD on a thread
        and, where a kept draft process can be started, in a process) on tuning
        prompts, keeps the fastest, and writes it as an SSDConfig (ssd_config.json) that generate() picks up from
        the model directory, with a table of everything it tried. The tuning prompts come from HumanEval; report
        speed on other prompt sets (`hf-ssd bench --prompt-set mtbench`), never on the ones tuned on.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

TUNE_PROMPT_SET = "humaneval"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="default", help="model pair from hf_ssd.tools.assets.PAIRS")
    p.add_argument("--tiny", action="store_true", help="a tiny random pair (seconds; for checking the tool)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompts", type=int, default=3, help="tuning prompts (HumanEval)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per plan (the median counts)")
    p.add_argument("--top", type=int, default=2, help="plans tried per mode (per SSD worker), best predicted first")
    p.add_argument("--out", default=None, help="where to write ssd_config.json (default: the target's model dir)")
    p.add_argument("--modes", default="plain,sync,ssd", help="plans to try, e.g. sync,ssd (default: all)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="also upload the config to this Hub repo")
    p.add_argument("--doctor", action="store_true", help="only explain the measured costs; write nothing")


def load(args):
    if args.tiny:
        from hf_ssd.testing import tiny_pair

        return tiny_pair()
    from hf_ssd.tools.assets import load_default_pair

    return load_default_pair()


def tuning_batches(tokenizer, n: int, batch: int) -> list[dict]:
    from hf_ssd.tools.prompts import format_chat, load_prompts

    texts = [format_chat(tokenizer, r["prompt"]) for r in load_prompts(TUNE_PROMPT_SET, n=max(n, batch), max_chars=800)]
    return [tokenizer(texts[i:i + batch], return_tensors="pt", padding=True, padding_side="left")
            for i in range(0, len(texts) - batch + 1, batch)]


def timed(target, draft, batches, options: dict | None, max_new_tokens: int, repeats: int) -> dict:
    """Median decode tok/s of a plan over the tuning batches (options None: transformers' plain generate)."""
    runs = []
    for _ in range(repeats):
        tokens, seconds = 0, 0.0
        for enc in batches:
            kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=target.generation_config.pad_token_id
                      or 0)
            if options is not None:  # {}: ssd=True and nothing else (the config comes from the model directory)
                kw.update(assistant_model=draft, ssd=True)
                if options:
                    kw["ssd_config"] = options
            start = time.perf_counter()
            out = target.generate(**enc, **kw)
            seconds += time.perf_counter() - start
            tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
        runs.append(tokens / seconds)
    return {"median_tok_s": statistics.median(runs), "min_tok_s": min(runs), "max_tok_s": max(runs), "runs": runs}


def run(args: argparse.Namespace) -> int:
    import hf_ssd  # noqa: F401  (enables ssd=True)
    from tqdm.auto import tqdm

    from hf_ssd.config import SSDConfig
    from hf_ssd.control.decision import family
    from hf_ssd.control.explain import diagnose
    from hf_ssd.kernels.packed_linear import describe as packed_linear_description
    from hf_ssd.session import make_controller
    from hf_ssd.workers import pool

    target, draft, tokenizer = load(args)
    device = target.get_input_embeddings().weight.device
    # process-worker plans are tried where a kept draft process can be started (a written config that names one
    # runs on the draft's kept process, started at its first call)
    processes = pool.spawn_hazard() is None
    controller = make_controller(target, draft, args.batch, True, SSDConfig(), device, None, process_ready=processes)
    print(f"measured the pair in {controller.costs.probe_s:.1f} s")
    for line in diagnose(controller.costs, controller):
        print("-", line)
    print(f"- Packed few-row linear kernel (ssd_packed_linear): target {packed_linear_description(target)}; "
          f"draft {packed_linear_description(draft)}.")
    if args.doctor:
        return 0
    batches = tuning_batches(tokenizer, args.prompts, args.batch)
    preds = sorted((controller.predict(p) for p in controller.plans), key=lambda x: -x.tokens_per_s)
    shortlist = []  # the best `top` plans of each family (plain, sync, ssd on a thread, ssd in a process)
    for mode in args.modes.split(","):
        families = dict.fromkeys(family(p.plan) for p in preds if p.plan.mode == mode)
        for fam in families:
            shortlist += [p for p in preds if family(p.plan) == fam][: args.top]
    # warm-up: kernels, the int8 copy, worker threads
    target.generate(**batches[0], max_new_tokens=4, do_sample=False)
    tried = []
    for pred in tqdm(shortlist, desc="tune: timing plans", unit="plan"):
        options = None if pred.plan.mode == "plain" else SSDConfig(**pred.plan.options())
        if options is not None:
            timed(target, draft, batches[:1], options, 4, 1)  # warm this plan's own shapes and threads
        result = timed(target, draft, batches, options, args.max_new_tokens, args.repeats)
        tried.append({"plan": pred.plan.label, "options": None if options is None else options.to_dict(),
                      "predicted_tok_s": round(pred.tokens_per_s, 3), **{k: v for k, v in result.items()}})
    tried.sort(key=lambda r: -r["median_tok_s"])
    best = tried[0]
    out_dir = Path(args.out) if args.out else Path(str(getattr(target, "name_or_path", "") or "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    print("\n| plan | predicted tok/s | measured tok/s, median (min-max) |\n|---|---|---|")
    for r in tried:
        print(f"| {r['plan']} | {r['predicted_tok_s']:.2f} | {r['median_tok_s']:.2f} "
              f"({r['min_tok_s']:.2f}-{r['max_tok_s']:.2f}) |")
    table = {"batch": args.batch, "prompt_set": TUNE_PROMPT_SET, "prompts": args.prompts, "tried": tried}
    (out_dir / "ssd_tune.json").write_text(json.dumps(table, indent=2) + "\n")
    if best["options"] is None:
        print(f"\nplain decoding is fastest here for this pair at batch {args.batch}; no SSD config written "
              f"(generate(..., ssd=True) keeps choosing by itself). Table: {out_dir / 'ssd_tune.json'}")
        return 0
    config = SSDConfig.from_dict(best["options"])
    path = config.save_pretrained(out_dir)
    if args.push_to_hub:
        config.push_to_hub(args.push_to_hub)
    print(f"\nbest: {best['plan']} at {best['median_tok_s']:.2f} tok/s; wrote {path} "
          f"(generate(..., ssd=True) picks it up from that model directory). Table: {out_dir / 'ssd_tune.json'}")
    check = reproduce(target, draft, batches, out_dir, best, args)
    (out_dir / "ssd_tune.json").write_text(json.dumps({**table, "check": check}, indent=2) + "\n")
    print(f"check: generate(..., ssd=True) with no other option, config read from {out_dir}: "
          f"{check['median_tok_s']:.2f} tok/s ({check['ratio_to_tuned']:.2f}x the tuned run; mode "
          f"{check['mode']}, K={check['K']})")
    return 0


def reproduce(target, draft, batches, out_dir: Path, best: dict, args) -> dict:
    """Time generate(..., ssd=True) with no option but the written config (read from `out_dir`, as from a model
    directory): does a later call get the tuned speed? Same batches and repeats as the tuning runs."""
    from hf_ssd.config import SSDConfig

    # where generate() looks for ssd_config.json: the model's name_or_path (set by from_pretrained), else its config's
    saved = target.config._name_or_path, getattr(target, "name_or_path", None)
    target.config._name_or_path = str(out_dir)
    if saved[1] is not None:
        target.name_or_path = str(out_dir)
    try:
        enc = batches[0]
        out = target.generate(**enc, assistant_model=draft, ssd=True, max_new_tokens=4, do_sample=False,
                              pad_token_id=target.generation_config.pad_token_id or 0, return_dict_in_generate=True)
        stats = out.ssd_stats
        result = timed(target, draft, batches, {}, args.max_new_tokens, args.repeats)
    finally:
        target.config._name_or_path = saved[0]
        if saved[1] is not None:
            target.name_or_path = saved[1]
    return {**result, "ratio_to_tuned": result["median_tok_s"] / best["median_tok_s"], "mode": stats["mode"],
            "K": SSDConfig.from_pretrained(out_dir).num_draft_tokens, "controller": stats["controller"]}
