"""`hf-ssd bench`: plain generate() vs transformers' assisted generation vs our sync SD vs SSD, side by side.

Python API::

    from hf_ssd.bench import BenchConfig, run_bench, write_report
    report = run_bench(BenchConfig(tiny=True, max_new_tokens=8))
    write_report(report, "benchmarks/")

`hf_ssd.bench.simulate` holds the speed-model predictions (every figure labelled SIMULATED).
"""
from .report import SCHEMA_VERSION, validate_report, write_report
from .runner import BenchConfig, Method, run_bench

__all__ = ["BenchConfig", "Method", "run_bench", "write_report", "validate_report", "SCHEMA_VERSION"]
