"""Tooling around the library: CLI, demo, default-pair assets, prompt sets, bench, evaluation, metrics.

Its extra dependencies come with `pip install hf-ssd[tools]`; the library itself never imports this package.
"""
