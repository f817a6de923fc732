"""`hf-ssd doctor`: what this machine can sustain for a model pair, in plain words (the first half of `tune`)."""
from __future__ import annotations

import argparse

from hf_ssd.tools import tune


def add_arguments(p: argparse.ArgumentParser) -> None:
    tune.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    args.doctor = True
    return tune.run(args)
