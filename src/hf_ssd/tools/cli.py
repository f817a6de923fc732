"""`hf-ssd`: demo | bench | simulate | eval | gpu-check. Each subcommand lives in its own module."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help); each module defines `add_arguments(parser)` and `run(args) -> int`
COMMANDS = {
    "demo": ("hf_ssd.tools.demo", "generate on a real prompt with the default pair: plain vs SD vs SSD, measured"),
    "bench": ("hf_ssd.tools.bench.cli", "benchmark plain, transformers' assisted, our SD and SSD side by side"),
    "simulate": ("hf_ssd.tools.bench.simulate", "speed model: predicted SD/SSD speedups (simulated figures)"),
    "eval": ("hf_ssd.tools.evaluation.cli", "quality checks: fidelity, acceptance, HumanEval pass@1"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-ssd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:
            if not module.startswith(exc.name or "?"):
                raise
            p.set_defaults(_missing=module)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        parser.error(f"`{args.command}` is not available in this install ({args._missing} missing)")
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
