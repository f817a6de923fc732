"""`hf-ssd bench`: argument parsing and the quick/full profiles around hf_ssd.tools.bench.runner."""
from __future__ import annotations

import argparse
import shlex
import sys

from hf_ssd.tools.bench.runner import DEFAULT_METHODS, HF_SCHEDULES, OPTIONAL_METHODS, SETTINGS, WORKLOADS, BenchConfig

# --quick: 2 HumanEval prompts, 32 tokens, batch 1, greedy, paper setting, two transformers schedules; 3 repeats
# (medians need them, even quick).
QUICK = dict(prompts=("humaneval",), num_prompts=2, max_new_tokens=32, batch_sizes=(1,), temperatures=(0.0,),
             settings=("paper",), hf_schedules=("constant", "heuristic"), warmup=1, repeats=3)
# full profile: every prompt set (each reported on its own rows), batch 1-16 (16 prompts per set, so batch 16 is
# full), T in {0, 0.7, 1.0}, both settings.
FULL = dict(prompts=("humaneval", "mtbench", "sharegpt"), num_prompts=16, max_new_tokens=128,
            batch_sizes=(1, 4, 16), temperatures=(0.0, 0.7, 1.0), settings=("paper", "equal"),
            hf_schedules=("constant", "heuristic", "default"), warmup=1, repeats=3)


def _csv(kind):
    def parse(text: str):
        return tuple(kind(x) for x in text.split(",") if x.strip())
    return parse


def _prompts_arg(text: str):
    """--prompts: an integer N (prompts per set, like --num-prompts) or, as before, a comma list of prompt sets."""
    return int(text) if text.strip().isdigit() else _csv(str)(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--workload", default="default", choices=WORKLOADS,
                   help="default: the pair from --pair/--target/--draft/--tiny (today's behaviour); overhead: the "
                        "overhead-bound CPU stand-in for the GPU regime, built from configs in seconds: a 28-layer "
                        "Qwen2 target at hidden 64 whose layers 8-27 add nothing, and its first 8 layers as draft "
                        "(alpha = 1 unless --alpha-noise); ignores --pair/--target/--draft/--dtype")
    g.add_argument("--alpha-noise", type=float, default=0.0,
                   help="overhead workload: seeded noise on the draft's weights (x each weight's std) to bring the "
                        "acceptance alpha below 1; 0 = draft equals target (alpha 1); see benchmarks/README.md for "
                        "the noise that gives alpha ~0.7")
    g.add_argument("--pair", default="default", help="asset pair (see hf_ssd.tools.assets.PAIRS); default: Qwen2.5-Coder "
                   "1.5B target + 0.5B draft")
    g.add_argument("--target", help="target model dir (with --draft, instead of --pair)")
    g.add_argument("--draft", help="draft model dir")
    g.add_argument("--tiny", action="store_true", help="random tiny models from a config (CI; seconds)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="float32 (default) keeps greedy equality meaningful; bf16 is faster but the multi-token "
                        "verify flips an argmax now and then")
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-set", type=_csv(str), dest="prompt_set",
                   help="comma list of humaneval,mtbench,sharegpt; each set is reported on its own rows. Quote "
                        "mtbench/sharegpt: held out from any tuning on HumanEval")
    g.add_argument("--prompts", type=_prompts_arg,
                   help="N = prompts per set (same as --num-prompts); a comma list of set names still works as "
                        "--prompt-set")
    g.add_argument("--num-prompts", type=int, help="prompts per set (balanced over categories)")
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--batch-sizes", type=_csv(int), help="e.g. 1,4,16")
    g.add_argument("--temperatures", type=_csv(float), help="e.g. 0,0.7")
    g.add_argument("--setting", type=_csv(str), dest="settings",
                   help=f"comma list of {','.join(SETTINGS)} (paper: target 1 thread in every method, SSD's draft a "
                        "2nd core; equal: every method may use both cores)")
    g.add_argument("--methods", type=_csv(str), default=DEFAULT_METHODS,
                   help=f"comma list (default {','.join(DEFAULT_METHODS)}): plain = eager generate(); "
                        "plain:static-compile = generate() with cache_implementation='static' + torch.compile "
                        "(transformers' compile_config path; compiled in the warm-up); hf = every --hf-schedules "
                        f"assisted schedule (or one: {','.join('hf:' + s for s in HF_SCHEDULES)}); "
                        "hf:prompt-lookup = transformers' prompt lookup decoding (prompt_lookup_num_tokens=K); "
                        "sd = our sync SD; sd:unpacked = the same with ssd_packed_linear=False (torch's GEMM, not the packed "
                        "few-row kernel); ssd = SSD with every --workers kind; auto = ssd=True with no option; "
                        "auto:warmup = the same after hf_ssd.warmup(draft_process=True) (not with auto). "
                        f"{' and '.join(OPTIONAL_METHODS)} failing is reported, not fatal")
    g.add_argument("--hf-schedules", type=_csv(str), help="transformers schedules: constant,heuristic,default")
    g.add_argument("--workers", type=_csv(str), help="SSD worker kinds to try (default: all the engine provides)")
    g.add_argument("--compile", choices=("off", "on", "both"), default="off",
                   help="our SD/SSD rows eager (off), compiled (on: ssd_compile + ssd_compile_target, static caches, "
                        "rows named '+compile', compiled in the warm-up) or both")
    g = p.add_argument_group("SSD / SD options")
    g.add_argument("--K", type=_csv(int), default=(4,),
                   help="draft tokens per round (also HF's num_assistant_tokens and prompt lookup's tokens); a comma "
                        "list runs every method that drafts a fixed K once per K (rows named '@K3'), so each is "
                        "compared at its best K")
    g.add_argument("--budget", type=_csv(int), help="SSD branches per row (default: measured by the engine); a comma "
                   "list runs the SSD rows once per budget (rows named '@K3b16' with several K, '@b16' with one)")
    g.add_argument("--downweight", type=float, default=1.0, help="Saguaro C in [0, 1]")
    g.add_argument("--draft-quantize", choices=["int8"], default=None,
                   help="int8 copy of the draft (CPU) for every method that drafts (HF assisted, SD, SSD)")
    g.add_argument("--target-threads", type=int, help="parallel SSD workers, equal setting (default 1)")
    g.add_argument("--draft-threads", type=int, help="parallel SSD workers, equal setting (default 1)")
    g = p.add_argument_group("run")
    g.add_argument("--warmup", type=int)
    g.add_argument("--repeats", type=int, help="timed passes over every prompt batch (default 3, --quick too); "
                   "tok/s = median over them, reported with min-max")
    g.add_argument("--seed", type=int, default=0)
    prof = g.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="2 HumanEval prompts x 32 tokens, batch 1, greedy, paper "
                      "setting, 3 repeats")
    prof.add_argument("--full", action="store_true", help="every prompt set, batch 1-16, 3 temperatures, both settings")
    g.add_argument("--out", default="benchmarks", help="output directory (bench.json, table.md, *.png)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")


def _one_or_all(values: tuple | None):
    """A single value as itself (the report's config keeps its old form), several as the tuple to sweep."""
    return values[0] if values and len(values) == 1 else values


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    base = dict(QUICK if args.quick or not args.full else FULL)
    if args.tiny:  # CI: seconds
        base.update(num_prompts=1, max_new_tokens=8, warmup=0)
    over = {k: getattr(args, k) for k in ("num_prompts", "max_new_tokens", "batch_sizes", "temperatures",
                                          "settings", "hf_schedules", "warmup", "repeats")
            if getattr(args, k, None) is not None}
    if isinstance(args.prompts, int):
        over.setdefault("num_prompts", args.prompts)
    elif args.prompts:
        over["prompts"] = args.prompts
    if args.prompt_set:
        over["prompts"] = args.prompt_set
    from hf_ssd.tools.prompts import PROMPT_SETS

    unknown = [s for s in over.get("prompts", ()) if s not in PROMPT_SETS]
    if unknown:
        raise SystemExit(f"unknown prompt set(s) {unknown}; choose from {','.join(PROMPT_SETS)}")
    base.update(over)
    return BenchConfig(
        pair=args.pair, target=args.target, draft=args.draft, tiny=args.tiny, dtype=args.dtype,
        workload=args.workload, alpha_noise=args.alpha_noise,
        max_prompt_tokens=args.max_prompt_tokens, methods=tuple(args.methods), workers=args.workers,
        compile=args.compile, K=_one_or_all(args.K), budget=_one_or_all(args.budget), downweight=args.downweight,
        draft_quantize=args.draft_quantize, target_threads=args.target_threads,
        draft_threads=args.draft_threads, seed=args.seed, progress=not args.no_progress, **base)


def run(args: argparse.Namespace) -> int:
    from hf_ssd.tools.bench.report import markdown_table, validate_report, write_report
    from hf_ssd.tools.bench.runner import run_bench

    cfg = config_from_args(args)
    argv = sys.argv[1:]
    if argv and argv[0] == "bench":
        argv, prog = argv[1:], "hf-ssd bench"
    else:
        prog = "python -m hf_ssd.tools.bench.cli" if sys.argv[0].endswith("cli.py") else "hf-ssd bench"
    command = " ".join([prog] + [shlex.quote(a) for a in argv])
    report = run_bench(cfg, command=command)
    paths = write_report(report, args.out, plots=not args.no_plots)
    print(markdown_table(report))
    print("\nwrote " + ", ".join(paths.values()))
    for r in report["results"]:
        if r.get("fallback_reason"):
            print(f"warning: {r['method']} ({r['setting']}, T={r['temperature']}, b={r['batch_size']}) fell back to "
                  f"sync SD: {r['fallback_reason']}", file=sys.stderr)
    problems = validate_report(report)
    for p in problems:
        print(f"report problem: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_ssd.tools.bench.cli ...` (same options as `hf-ssd bench`)."""
    parser = argparse.ArgumentParser(prog="hf-ssd bench", description="benchmark plain, transformers' assisted, "
                                     "our SD and SSD side by side")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
