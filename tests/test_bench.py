"""hf-ssd bench: metric arithmetic, report schema, prompt loading, speed model, one tiny end-to-end run (seconds)."""
from __future__ import annotations

import json

import pytest
import torch

from hf_ssd.tools.bench import BenchConfig, run_bench, validate_report, write_report
from hf_ssd.tools.bench.cli import add_arguments, config_from_args
from hf_ssd.tools.bench.report import PLOTS, markdown_table
from hf_ssd.tools.bench.aggregate import add_speedups, aggregate_runs, greedy_equal
from hf_ssd.tools.bench.runner import Method, threads_for
from hf_ssd.tools.bench.workload import ByteTokenizer, left_pad, load_bench_prompts, new_tokens
from hf_ssd.tools.bench.simulate import PAPER, PaperAssumptions, measured_vs_predicted, paper_prediction, simulate


def _stats(emitted, hist, hits, lookups, verify, draft, resolve, rounds):
    return {"emitted": emitted, "accepted": emitted - sum(hist.values()), "accept_hist": hist, "cache_hits": hits,
            "cache_lookups": lookups, "rounds": rounds, "overlap_fraction": 0.5, "budget": 8,
            "phase_means_s": {"verify": verify, "draft": draft, "resolve": resolve, "round": verify + draft},
            "fallback_reason": None, "backup_rounds": {"jit": 1}}


def test_aggregate_arithmetic():
    runs = [
        {"tokens": [[1] * 10], "wall_s": 2.0, "ttft_s": 0.5, "peak_rss_bytes": 2**20 * 100,
         "ssd_stats": _stats(10, {2: 2, 3: 1}, 2, 3, 0.1, 0.05, 0.0, 3)},
        {"tokens": [[1] * 6], "wall_s": 2.0, "ttft_s": 0.5, "peak_rss_bytes": 2**20 * 300,
         "ssd_stats": _stats(6, {1: 2}, 1, 2, 0.3, 0.05, 0.0, 1)},
    ]
    a = aggregate_runs(runs, batch=1)
    assert a["tokens_per_s_e2e"] == pytest.approx(16 / 4.0)
    assert a["tokens_per_s_decode"] == pytest.approx((16 - 2) / 3.0)
    assert a["mean_tokens_per_round"] == pytest.approx(16 / 5)  # Σ emitted / Σ row-rounds
    assert a["hit_rate"] == pytest.approx(3 / 5)
    assert a["phase_means_s"]["verify"] == pytest.approx((0.1 * 3 + 0.3 * 1) / 4)  # round-weighted
    limit = 1 * (16 / 5) / 0.15
    assert a["round_limit_tps"] == pytest.approx(limit)
    assert a["fraction_of_round_limit"] == pytest.approx((14 / 3) / limit)
    assert a["peak_rss_mb"] == pytest.approx(300)
    assert a["backup_rounds"] == {"jit": 2}
    plain = aggregate_runs([{"tokens": [[1] * 4, [1] * 4], "wall_s": 1.0, "ttft_s": 0.0, "peak_rss_bytes": 0,
                             "ssd_stats": None}], batch=2)
    assert plain["hit_rate"] is None and plain["tokens_per_s_decode"] == pytest.approx(6.0)


def test_speedups_and_greedy_equal():
    rows = [{"setting": "paper", "temperature": 0.0, "batch_size": 1, "method": m, "tokens_per_s_decode": v,
             "tokens_per_s_e2e": v / 2} for m, v in [("plain", 2.0), ("hf:a", 3.0), ("hf:b", 4.0), ("sd", 5.0),
                                                      ("ssd:inline", 6.0)]]
    rows.append({"setting": "paper", "temperature": 0.0, "batch_size": 4, "method": "plain",
                 "tokens_per_s_decode": 8.0, "tokens_per_s_e2e": 8.0})
    add_speedups(rows)
    ssd = rows[4]
    assert ssd["speedup_vs_plain"] == pytest.approx(3.0)
    assert ssd["speedup_vs_hf_best"] == pytest.approx(1.5)  # best schedule = 4 tok/s
    assert ssd["speedup_vs_sd"] == pytest.approx(1.2)
    assert ssd["speedup_vs_plain_e2e"] == pytest.approx(3.0)
    assert rows[5]["speedup_vs_hf_best"] is None and rows[5]["speedup_vs_plain"] == 1.0
    assert greedy_equal([[1, 2], [3]], [[1, 2], [3]]) == (True, 0)
    assert greedy_equal([[1, 2], [4]], [[1, 2], [3]]) == (False, 1)


def test_padding_tokens_and_threads():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    seq = torch.tensor([[9, 9, 1, 2, 3, 0], [9, 9, 4, 5, 6, 7]])
    assert new_tokens(seq, 2, {3}) == [[1, 2, 3], [4, 5, 6, 7]]
    cfg = BenchConfig()
    assert threads_for("paper", Method("plain", "plain"), cfg)["torch"] == 1
    assert threads_for("paper", Method("ssd:thread", "ssd", "thread"), cfg) == {"torch": 1, "target": 1, "draft": 1}
    assert threads_for("paper", Method("ssd:inline", "ssd", "inline"), cfg)["draft"] is None
    eq = threads_for("equal", Method("sd", "sd"), cfg)
    assert eq["torch"] == min(2, __import__("os").cpu_count() or 2)


def test_prompt_loading_for_bench():
    cfg = BenchConfig(prompts=("humaneval", "mtbench"), num_prompts=2, max_prompt_tokens=40, tiny=True)
    rows = load_bench_prompts(cfg, ByteTokenizer())
    assert [r["set"] for r in rows] == ["humaneval", "humaneval", "mtbench", "mtbench"]
    assert all(0 < len(r["input_ids"]) <= 40 for r in rows)
    assert rows[0]["category"] == "code" and rows[0]["id"].startswith("HumanEval/")
    assert rows[2]["category"] != rows[3]["category"]  # balanced over MT-Bench categories


def test_cli_profiles():
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    q = config_from_args(p.parse_args(["--quick"]))
    assert q.max_new_tokens == 32 and q.settings == ("paper",) and q.batch_sizes == (1,)
    f = config_from_args(p.parse_args(["--full", "--batch-sizes", "1,2", "--setting", "equal", "--K", "3"]))
    assert f.batch_sizes == (1, 2) and f.settings == ("equal",) and f.K == 3 and "sharegpt" in f.prompts


def test_speed_model_known_inputs():
    sim = paper_prediction(PaperAssumptions())
    d, pr = sim["derived"], sim["predicted"]
    assert sim["label"] == "SIMULATED"
    assert d["verify_ms"] == pytest.approx(1000 / 54.7)
    # SD is reproduced exactly by construction (tokens/round are backed out of it)
    assert pr["sd_tps"] == pytest.approx(PAPER["sd_tps"])
    t_draft = 7 * 2.5 / d["verify_ms"]
    e = PAPER["sd_tps"] / PAPER["ar_tps"] * (1 + t_draft)
    assert d["tokens_per_round"] == pytest.approx(e)
    t_tree = 8 * 2.5 * 1.05 / d["verify_ms"]
    expect = (e / (0.9 * max(1, t_tree) + 0.1 * (1 + t_draft) + 0.3 / d["verify_ms"])) * 54.7
    assert pr["ssd_tps"] == pytest.approx(expect)
    assert 1.3 < pr["ssd_over_sd"] < 1.8  # same ballpark as the paper's 1.58x
    hi = [s for s in sim["sensitivity"] if s["draft_step_ms"] == 2.5]
    assert [s["ssd_tps"] for s in hi] == sorted(s["ssd_tps"] for s in hi)  # more hits, faster


def test_measured_vs_predicted_from_report():
    ph = {"verify": 0.2, "draft": 0.1, "resolve": 0.02, "round": 0.3}
    rep = {"config": {"K": 4}, "results": [
        {"setting": "paper", "temperature": 0.0, "batch_size": 1, "method": "plain", "tokens_per_s_decode": 4.0},
        {"setting": "paper", "temperature": 0.0, "batch_size": 1, "method": "sd", "tokens_per_s_decode": 6.0,
         "phase_means_s": {"verify": 0.2, "draft": 0.4}, "mean_tokens_per_round": 3.0},
        {"setting": "paper", "temperature": 0.0, "batch_size": 1, "method": "ssd:inline", "batch_size_": 1,
         "tokens_per_s_decode": 7.0, "phase_means_s": ph, "mean_tokens_per_round": 3.0, "hit_rate": 0.8}]}
    (row,) = measured_vs_predicted(rep)
    assert row["label"] == "SIMULATED"
    assert row["inputs"]["draft_step_s"] == pytest.approx(0.1)
    assert row["inputs"]["backup_s"] == pytest.approx(0.1)  # resolve / (1 - p_hit)
    assert row["predicted_sd_tps"] == pytest.approx(3.0 / (0.2 + 0.4))
    # tree 0.1 < verify: 3 / (0.2 * (0.8 * 1 + 0.2 * 1.5))
    assert row["predicted_ssd_tps_parallel"] == pytest.approx(3.0 / (0.2 * (0.8 + 0.2 * 1.5)))
    assert simulate(rep)["measured_vs_predicted"]


def test_tiny_end_to_end(tmp_path):
    cfg = BenchConfig(tiny=True, prompts=("humaneval",), num_prompts=2, max_new_tokens=8,
                      hf_schedules=("constant", "heuristic"), workers=("inline", "thread"), warmup=1, repeats=1,
                      K=3, progress=False)
    report = run_bench(cfg, command="pytest tiny")
    paths = write_report(report, tmp_path)
    assert validate_report(report) == []
    methods = {r["method"] for r in report["results"]}
    assert {"plain", "hf:constant", "hf:heuristic", "sd", "ssd:inline"} <= methods
    for r in report["results"]:
        assert r["greedy_equal"] is True, r["method"]  # every method reproduces plain greedy exactly
        assert r["new_tokens"] > 0 and r["tokens_per_s_decode"] > 0
    ssd = next(r for r in report["results"] if r["method"] == "ssd:inline")
    assert ssd["hit_rate"] is not None and ssd["mean_tokens_per_round"] >= 1.0
    assert ssd["fraction_of_round_limit"] is not None
    loaded = json.loads((tmp_path / "bench.json").read_text())
    assert validate_report(loaded) == [] and loaded["schema_version"] == 1
    assert loaded["command"] == "pytest tiny" and loaded["versions"]["torch"] and loaded["machine"]["cpu_count"]
    table = (tmp_path / "table.md").read_text()
    assert "ssd:inline" in table and markdown_table(report).splitlines()[0] in table
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert set(paths) >= {"json", "table", *PLOTS}


def test_schema_rejects_incomplete():
    assert "missing top-level key 'results'" in validate_report({})
    bad = {"results": [{"method": "ssd:inline", "kind": "ssd", "temperature": 0.0}]}
    errs = validate_report(bad)
    assert any("hit_rate" in e for e in errs) and any("greedy" in e for e in errs)
