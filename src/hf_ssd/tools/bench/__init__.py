"""`hf-ssd bench`: plain generate() vs transformers' assisted generation vs our sync SD vs SSD, side by side.

Python API::

    from hf_ssd.tools.bench import BenchConfig, run_bench, write_report
    report = run_bench(BenchConfig(tiny=True, max_new_tokens=8))
    write_report(report, "benchmarks/")

`hf_ssd.tools.bench.simulate` holds the speed-model predictions (every figure labelled SIMULATED).
"""
from hf_ssd.tools.bench.report import SCHEMA_VERSION, validate_report, write_report
from hf_ssd.tools.bench.runner import BenchConfig, Method, run_bench

__all__ = ["BenchConfig", "Method", "run_bench", "write_report", "validate_report", "SCHEMA_VERSION"]
