"""hf-ssd bench: metric arithmetic, report schema, prompt loading, speed model, one tiny end-to-end run (seconds)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from hf_ssd.tools.bench import BenchConfig, run_bench, validate_report, write_report
from hf_ssd.tools.bench.cli import add_arguments, config_from_args
from hf_ssd.tools.bench.report import PLOTS, markdown_table
from hf_ssd.tools.bench import runner as bench_runner
from hf_ssd.tools.bench.aggregate import add_speedups, aggregate_repeats, aggregate_runs, greedy_equal, repeat_stats
from hf_ssd.tools.bench.overhead import overhead_pair
from hf_ssd.tools.bench.runner import DEFAULT_METHODS, Method, plan_methods, threads_for
from hf_ssd.tools.bench.workload import load_bench_prompts, new_tokens
from hf_ssd.tools.bench.simulate import (PAPER, PaperAssumptions, markdown, measured_vs_predicted, paper_prediction,
                                         simulate)
from hf_ssd.testing import byte_tokenizer, left_pad


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


def test_alpha_est_holds_when_runs_draft_different_K():
    """The controller ran K = 2 in one call (all accepted) and K = 5 in another (1 accepted, then a rejection):
    α = accepted / (accepted + rejections) = 25 / 30, whatever K the bench was told."""
    def run(hist, rejected):
        stats = {**_stats(10, hist, 0, 0, 0.1, 0.05, 0.0, 10), "rejected": rejected}
        return {"tokens": [[1] * 10], "wall_s": 1.0, "ttft_s": 0.1, "peak_rss_bytes": 0, "ssd_stats": stats}

    a = aggregate_runs([run({2: 10}, 0), run({1: 5}, 5)], batch=1)
    assert a["alpha_est"] == pytest.approx(25 / 30)


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


def test_best_plain_and_prompt_set_groups():
    rows = [{"setting": "paper", "temperature": 0.0, "batch_size": 1, "prompt_set": ps, "method": m,
             "tokens_per_s_decode": v, "tokens_per_s_e2e": v}
            for ps, m, v in [("humaneval", "plain", 2.0), ("humaneval", "plain:static-compile", 4.0),
                             ("humaneval", "hf:prompt-lookup", 5.0), ("humaneval", "sd", 6.0),
                             ("mtbench", "plain", 3.0), ("mtbench", "sd", 6.0)]]
    add_speedups(rows)
    sd_he, sd_mt = rows[3], rows[5]
    assert sd_he["speedup_vs_plain"] == pytest.approx(3.0)  # "× plain" stays against eager plain
    assert sd_he["speedup_vs_best_plain"] == pytest.approx(1.5)  # the compiled plain is faster here
    assert sd_he["speedup_vs_hf_best"] == pytest.approx(6 / 5)  # prompt lookup counts as a transformers method
    assert sd_mt["speedup_vs_plain"] == pytest.approx(2.0) and sd_mt["speedup_vs_best_plain"] == pytest.approx(2.0)


def test_repeats_median_min_max():
    assert repeat_stats([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert repeat_stats([None, 4.0])["median"] == 4.0 and repeat_stats([None])["median"] is None

    def run(wall):  # one batch of one row: 9 tokens, first after 0.1 s
        return {"tokens": [[1] * 9], "wall_s": wall, "ttft_s": 0.1, "peak_rss_bytes": 0, "ssd_stats": None}

    a = aggregate_repeats([[run(1.1)], [run(2.1)], [run(0.6)]], batch=1)
    st = a["tokens_per_s_decode_stats"]
    assert st["runs"] == pytest.approx([8.0, 4.0, 16.0]) and a["tokens_per_s_decode"] == pytest.approx(8.0)
    assert (st["min"], st["max"]) == pytest.approx((4.0, 16.0)) and a["repeats"] == 3 and a["runs"] == 3
    assert a["tokens_per_s_e2e"] == pytest.approx(9 / 1.1)  # the median repeat, not the pooled total


def test_plan_methods():
    cfg = BenchConfig(methods=DEFAULT_METHODS, hf_schedules=("constant",))
    names = [m.name for m in plan_methods(cfg, ["inline"])]
    assert names == ["plain", "plain:static-compile", "hf:constant", "hf:prompt-lookup", "sd", "ssd:inline", "ssd:auto"]
    assert [m.name for m in plan_methods(BenchConfig(methods=("hf:heuristic",)), [])] == ["hf:heuristic"]
    assert all(m.batch1_only for m in plan_methods(cfg, []) if m.kind == "hf")
    with pytest.raises(ValueError, match="unknown method"):
        plan_methods(BenchConfig(methods=("plain", "fast")), [])
    both = plan_methods(BenchConfig(methods=("sd", "ssd"), compile="both"), ["inline", "process"])
    assert [m.name for m in both] == ["sd", "sd+compile", "ssd:inline", "ssd:process", "ssd:inline+compile",
                                      "ssd:process+compile"]
    assert [m.engine_compiled for m in both] == [False, True, False, False, True, True]
    assert all(m.compiled for m in both if m.engine_compiled)  # warmed up until no new graph, timed runs checked
    assert [m.name for m in plan_methods(BenchConfig(methods=("sd",), compile="on"), [])] == ["sd+compile"]
    unpacked = plan_methods(BenchConfig(methods=("sd", "sd:unpacked")), [])
    assert [(m.name, m.kind, m.option) for m in unpacked] == [("sd", "sd", None), ("sd:unpacked", "sd", "unpacked")]


def test_K_and_budget_sweeps_make_one_row_each_and_our_SD_is_its_best_K():
    cfg = BenchConfig(methods=("plain", "hf", "hf:prompt-lookup", "sd", "ssd", "auto"), K=(2, 4), budget=(8, 16),
                      hf_schedules=("constant", "default"), compile="on")
    ms = plan_methods(cfg, ["process"])
    assert [m.name for m in ms] == [
        "plain", "hf:constant@K2", "hf:constant@K4", "hf:default", "hf:prompt-lookup@K2", "hf:prompt-lookup@K4",
        "sd+compile@K2", "sd+compile@K4", "ssd:process+compile@K2b8", "ssd:process+compile@K2b16",
        "ssd:process+compile@K4b8", "ssd:process+compile@K4b16", "ssd:auto+compile"]
    by = {m.name: m for m in ms}
    assert (by["ssd:process+compile@K4b8"].K, by["ssd:process+compile@K4b8"].budget) == (4, 8)
    assert by["sd+compile@K2"].K == 2 and by["sd+compile@K2"].budget is None
    assert by["hf:default"].K is None and by["ssd:auto+compile"].K is None  # these choose their own
    one = plan_methods(BenchConfig(methods=("sd", "ssd"), K=3, budget=(8, 16)), ["inline"])
    assert [m.name for m in one] == ["sd", "ssd:inline@b8", "ssd:inline@b16"] and one[0].K == 3
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    swept = config_from_args(p.parse_args(["--K", "2,3", "--budget", "16"]))
    assert swept.K == (2, 3) and swept.budget == 16 and swept.K_values == (2, 3) and swept.budget_values == (16,)
    rows = [{"setting": "paper", "temperature": 0.0, "batch_size": 1, "method": m, "tokens_per_s_decode": v,
             "tokens_per_s_e2e": v} for m, v in [("plain", 2.0), ("sd+compile@K2", 5.0), ("sd@K4", 6.0),
                                                 ("ssd:process+compile@K2b16", 9.0)]]
    add_speedups(rows)
    assert rows[3]["speedup_vs_sd"] == pytest.approx(1.5)  # against SD at its best K (6 tok/s), not at the same K



def test_a_swept_K_and_budget_reach_the_engine(tmp_path):
    """α = 1 (the overhead workload without noise): a round emits K + 1 tokens, so each row shows the K it ran."""
    cfg = BenchConfig(workload="overhead", methods=("plain", "sd", "ssd"), workers=("inline",), K=(1, 3),
                      budget=(2, 5), num_prompts=1, max_new_tokens=17, warmup=0, repeats=1, progress=False)
    report = run_bench(cfg, command="pytest sweep")
    write_report(report, tmp_path, plots=False)
    assert validate_report(report) == [] and report["method_errors"] == {}
    by = {r["method"]: r for r in report["results"]}
    assert set(by) == {"plain", "sd@K1", "sd@K3", "ssd:inline@K1b2", "ssd:inline@K1b5", "ssd:inline@K3b2",
                       "ssd:inline@K3b5"}
    for name, r in by.items():
        assert r["greedy_equal"] is True, name
        if name != "plain":
            assert r["mean_accepted_per_round"] == pytest.approx(r["K"], abs=0.5), name
    assert by["ssd:inline@K3b5"]["budget"] == 5 and by["ssd:inline@K1b2"]["budget"] == 2

def test_our_sd_is_its_best_compile_setting():
    rows = [{"setting": "paper", "temperature": 0.0, "batch_size": 1, "prompt_set": "humaneval", "method": m,
             "tokens_per_s_decode": v, "tokens_per_s_e2e": v}
            for m, v in [("plain", 2.0), ("sd", 4.0), ("sd+compile", 8.0), ("ssd:process+compile", 10.0)]]
    add_speedups(rows)
    assert rows[3]["speedup_vs_sd"] == pytest.approx(10 / 8)  # against the faster SD, compiled here
    assert rows[1]["speedup_vs_sd"] == pytest.approx(0.5)


def test_padding_tokens_and_threads():
    ids, mask = left_pad([[5, 6, 7], [8]], pad=0)
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
    rows = load_bench_prompts(cfg, byte_tokenizer())
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
    assert q.repeats == 3 and q.workload == "default" and q.methods == DEFAULT_METHODS
    o = config_from_args(p.parse_args(["--workload", "overhead", "--alpha-noise", "0.014", "--prompts", "6",
                                       "--max-new-tokens", "64", "--prompt-set", "mtbench,sharegpt"]))
    assert (o.workload, o.alpha_noise, o.num_prompts, o.max_new_tokens) == ("overhead", 0.014, 6, 64)
    assert o.prompts == ("mtbench", "sharegpt")
    legacy = config_from_args(p.parse_args(["--prompts", "mtbench", "--num-prompts", "3", "--repeats", "5"]))
    assert legacy.prompts == ("mtbench",) and legacy.num_prompts == 3 and legacy.repeats == 5
    with pytest.raises(SystemExit):
        config_from_args(p.parse_args(["--prompt-set", "gsm8k"]))
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
    expect = (e / (max(1, t_tree) + 0.1 * t_draft + 0.3 / d["verify_ms"])) * 54.7  # every round waits for the tree
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
    sim = simulate(rep, draft_costs=(0.29,))
    assert sim["measured_vs_predicted"]
    assert [r["alpha"] for r in sim["ceiling"]] == [1.0, 0.9, 0.8, 0.7]
    assert "What SSD can gain over SD at best" in markdown(sim)


def test_tiny_end_to_end(tmp_path):
    """Every default method (plain:static-compile compiles a 2-layer model in the warm-up: ~20 s of this test)."""
    cfg = BenchConfig(tiny=True, prompts=("humaneval",), num_prompts=2, max_new_tokens=8,
                      hf_schedules=("constant", "heuristic"), workers=("inline", "thread"), warmup=1, repeats=3,
                      K=3, progress=False)
    report = run_bench(cfg, command="pytest tiny")
    paths = write_report(report, tmp_path)
    assert validate_report(report) == [] and report["method_errors"] == {}
    methods = {r["method"] for r in report["results"]}
    assert {"plain", "plain:static-compile", "hf:constant", "hf:heuristic", "hf:prompt-lookup", "sd",
            "ssd:inline"} <= methods
    for r in report["results"]:
        assert r["greedy_equal"] is True, r["method"]  # every method reproduces plain greedy exactly
        assert r["new_tokens"] > 0 and r["tokens_per_s_decode"] > 0
        st = r["tokens_per_s_decode_stats"]
        assert len(st["runs"]) == 3 and st["min"] <= st["median"] == r["tokens_per_s_decode"] <= st["max"]
        assert r["prompt_set"] == "humaneval" and r["speedup_vs_best_plain"] is not None
    compiled = next(r for r in report["results"] if r["method"] == "plain:static-compile")
    assert compiled["graphs_compiled_in_timed_runs"] == 0  # the compile happened in the warm-up
    sd = next(r for r in report["results"] if r["method"] == "sd")
    assert sd["speedup_vs_plain"] == pytest.approx(
        sd["tokens_per_s_decode"] / next(r for r in report["results"] if r["method"] == "plain")["tokens_per_s_decode"])
    ssd = next(r for r in report["results"] if r["method"] == "ssd:inline")
    assert ssd["hit_rate"] is not None and ssd["mean_tokens_per_round"] >= 1.0
    assert ssd["fraction_of_round_limit"] is not None
    loaded = json.loads((tmp_path / "bench.json").read_text())
    assert validate_report(loaded) == [] and loaded["schema_version"] == 2
    assert loaded["results"][0]["tokens_per_s_e2e_stats"].keys() >= {"median", "min", "max", "runs"}
    assert loaded["command"] == "pytest tiny" and loaded["versions"]["torch"] and loaded["machine"]["cpu_count"]
    table = (tmp_path / "table.md").read_text()
    assert "ssd:inline" in table and markdown_table(report).splitlines()[0] in table
    assert "× best plain" in table and "Workload: **default**" in table and "**humaneval**" in table
    plain_row = next(line for line in table.splitlines() if line.startswith("| paper | 0 | 1 | humaneval | plain |"))
    assert re.search(r"\| \d+\.\d\d \(\d+\.\d\d–\d+\.\d\d\) \|", plain_row)  # median (min–max)
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert set(paths) >= {"json", "table", *PLOTS}


def test_schema_rejects_incomplete():
    assert "missing top-level key 'results'" in validate_report({})
    bad = {"results": [{"method": "ssd:inline", "kind": "ssd", "temperature": 0.0}]}
    errs = validate_report(bad)
    assert any("hit_rate" in e for e in errs) and any("greedy" in e for e in errs)


def test_overhead_workload_alpha_one(tmp_path):
    """28-layer target whose layers 8.. add nothing + its first 8 layers as draft: the same logits, so greedy SSD
    accepts every drafted token; the bench says which workload ran."""
    target, draft, tok = overhead_pair()
    assert (target.config.num_hidden_layers, draft.config.num_hidden_layers) == (28, 8)
    assert all(not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
               for layer in target.model.layers[8:])
    ids = torch.tensor([tok.encode("def add(a, b):")])
    with torch.no_grad():
        assert torch.equal(target(ids).logits, draft(ids).logits)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, ssd=True,
                              ssd_mode="ssd", ssd_worker="inline", ssd_num_draft_tokens=4, ssd_draft_quantize=None,
                              ssd_backup="jit", max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    # every round accepts all K drafts (backup "jit": a round the cache misses is drafted by the same draft model;
    # the n-gram backup the engine may pick would accept less)
    assert out.ssd_stats["mean_accepted"] == 4.0 and out.sequences.shape[1] == ids.shape[1] + 10
    _, noisy, _ = overhead_pair(alpha_noise=0.05)
    assert not torch.equal(noisy.lm_head.weight, draft.lm_head.weight)

    cfg = BenchConfig(workload="overhead", tiny=True, methods=("plain", "sd", "ssd"), workers=("inline",),
                      num_prompts=1, max_new_tokens=10, K=4, warmup=0, repeats=1, progress=False)
    report = run_bench(cfg, command="pytest overhead")
    write_report(report, tmp_path, plots=False)
    assert validate_report(report) == [] and report["workload"] == "overhead"
    for r in report["results"]:
        assert r["greedy_equal"] is True and r["new_tokens"] == 10, r["method"]  # no EOS: fixed length
    sd = next(r for r in report["results"] if r["method"] == "sd")
    assert sd["mean_accepted_hist"] == 4.0 and sd["alpha_est"] == pytest.approx(1.0)
    assert "Workload: **overhead**" in (tmp_path / "table.md").read_text()


def test_overhead_compiled_rows_and_controller_choice(tmp_path):
    """--compile on: our SD/SSD run with static, compiled caches on both sides (exact, compiled in the warm-up);
    the ssd:auto row records the plan the controller ran. The budget is set: left to the controller it follows
    measured costs, and a new budget is a new tree shape, which compiles wherever it is first chosen."""
    cfg = BenchConfig(workload="overhead", tiny=True, methods=("plain", "sd", "ssd", "auto"), workers=("inline",),
                      compile="on", num_prompts=1, max_new_tokens=12, K=3, budget=4, warmup=1, repeats=1,
                      progress=False)
    report = run_bench(cfg, command="pytest overhead compiled")
    write_report(report, tmp_path, plots=False)
    assert validate_report(report) == []
    by = {r["method"]: r for r in report["results"]}
    assert set(by) == {"plain", "sd+compile", "ssd:inline+compile", "ssd:auto+compile"}
    for name in ("sd+compile", "ssd:inline+compile"):
        r = by[name]
        assert r["greedy_equal"] is True and r["engine_compiled"]
        assert r["graphs_compiled_in_timed_runs"] == 0, name
        assert r["mean_tokens_per_round"] > 1 and r["fallback_reason"] is None
    auto = by["ssd:auto+compile"]
    assert auto["greedy_equal"] is True and auto["controller_choice"] and auto["controller_reason"]
    assert f"ssd:auto+compile (ran {auto['controller_choice']}" in (tmp_path / "table.md").read_text()
    # each timed call of the auto row keeps its own record: the row keeps only the last call's choice
    calls = [s["controller"] for s in report["samples"] if s["method"] == "ssd:auto+compile"]
    assert calls and all(c["ended_on"] and c["first_reason"] and c["predicted"] for c in calls)
    assert calls[-1]["ended_on"] == auto["controller_choice"]
    assert all("controller" not in s for s in report["samples"] if s["method"] != "ssd:auto+compile")
    # and which backup served its misses, per call (plain has no rounds to serve)
    assert all(isinstance(s["backup_rounds"], dict) for s in report["samples"] if s["method"] != "plain")
    assert all(s["backup_rounds"] is None for s in report["samples"] if s["method"] == "plain")


def test_failed_optional_method_is_reported(monkeypatch, tmp_path):
    """A baseline that cannot run here (e.g. torch.compile unsupported) lands in method_errors, not a crash."""
    def broken(model):
        raise RuntimeError("inductor: no C++ compiler")

    monkeypatch.setattr(bench_runner, "static_compile_config", broken)
    cfg = BenchConfig(tiny=True, methods=("plain", "plain:static-compile"), num_prompts=1, max_new_tokens=4,
                      warmup=0, repeats=1, progress=False)
    report = run_bench(cfg)
    write_report(report, tmp_path, plots=False)
    assert [r["method"] for r in report["results"]] == ["plain"] and validate_report(report) == []
    assert "no C++ compiler" in report["method_errors"]["plain:static-compile"]["error"]
    assert "plain:static-compile (RuntimeError: inductor: no C++ compiler)" in (tmp_path / "table.md").read_text()


def test_methods_are_timed_interleaved(monkeypatch):
    """After every method's warm-up, each prompt batch runs every method back to back, the order rotating with the
    repeat (the machine's drift hits all methods of a group alike); eager plain runs first on the first pass, so
    every greedy check has its reference."""
    calls = []
    real = bench_runner.generate_once

    seeds = []

    def recording(m, target, draft, ids, mask, **kw):
        calls.append((m.name, tuple(ids[0].tolist()), kw["max_new_tokens"] is None))
        if kw["max_new_tokens"] is None:
            seeds.append(kw["seed"])
        return real(m, target, draft, ids, mask, **kw)

    monkeypatch.setattr(bench_runner, "generate_once", recording)
    cfg = BenchConfig(tiny=True, methods=("plain", "sd", "auto"), num_prompts=2, max_new_tokens=6, warmup=1,
                      repeats=3, progress=False)
    report = run_bench(cfg)
    timed = [(name, last) for name, last, full in calls if full]
    warm = [name for name, _, full in calls if not full]
    assert warm == ["plain", "sd", "ssd:auto"]  # warm-ups (short) come first, one method after the other
    assert calls.index(next(c for c in calls if c[2])) == 3  # ... and all of them before any timed call
    batches = list(dict.fromkeys(last for _, last in timed))
    assert len(batches) == 2 and len(timed) == 3 * 2 * 3
    for rep in range(3):
        for bi in range(2):
            group = timed[(rep * 2 + bi) * 3:(rep * 2 + bi + 1) * 3]
            assert {last for _, last in group} == {batches[bi]}
            order = ["plain", "sd", "ssd:auto"]
            assert [name for name, _ in group] == order[rep:] + order[:rep]
    # one seed per pass for every method (sampled runs draw a new sample of each prompt per pass)
    assert seeds == [rep for rep in range(3) for _ in range(2 * 3)]
    by = {r["method"]: r for r in report["results"]}
    assert by["sd"]["greedy_equal"] is True and by["sd"]["greedy_equal_runs"] == "6/6"
    assert by["ssd:auto"]["greedy_equal"] is True and by["plain"]["repeats"] == 3


def test_compiled_auto_is_warmed_up_through_the_controllers_free_compiling_calls():
    """`ssd=True` with compile compiles whatever plan its first calls of a setting try (COMPILE_FREE_CALLS of its own
    choice; calls that explore do not count): those are its warm-up, so the bench leaves them all untimed, until a
    call's stats say it was no longer free, also with one prompt batch (batch 16 had left one timed)."""
    from types import SimpleNamespace

    from hf_ssd.control.compiled import COMPILE_FREE_CALLS, COMPILE_FREE_MAX_CALLS
    from hf_ssd.tools.bench.interleave import _warm_up

    def warm_calls(kind: str, compiled: bool, free: int = COMPILE_FREE_CALLS) -> int:
        calls = []

        def generate(batch, max_new_tokens=None):
            calls.append(batch)
            return {"ssd_stats": {"controller": {"compiling_free": len(calls) <= free}}}

        m = SimpleNamespace(kind=kind, option=None, compiled=compiled, engine_compiled=compiled)
        cfg = BenchConfig(tiny=True, warmup=1, max_new_tokens=8)
        _warm_up(m, ["only batch"], generate, cfg, object(), object(), SimpleNamespace(update=lambda: None))
        return len(calls)

    # the free calls, and the first that was not (it says so): the timed ones compile nothing they choose for free
    assert warm_calls("auto", True) == COMPILE_FREE_CALLS + 1
    assert warm_calls("auto", True, free=9) == 10  # three of the first calls explored: more free calls
    assert warm_calls("auto", True, free=100) <= 2 + COMPILE_FREE_MAX_CALLS  # bounded
    assert warm_calls("auto", False) < COMPILE_FREE_CALLS  # eager: nothing compiles in its calls
    assert warm_calls("ssd", True) < COMPILE_FREE_CALLS  # a fixed plan is warm once its graphs are built


def test_auto_warmup_rows_start_the_kept_draft_process_before_their_first_call(monkeypatch):
    """`auto:warmup`: ssd=True as a server runs it, after `hf_ssd.warmup(target, draft, draft_process=True)`, outside
    the timed calls; it cannot share a run with `auto`, whose calls the process would then serve too."""
    from types import SimpleNamespace

    import hf_ssd
    from hf_ssd.tools.bench.interleave import _warm_up
    from hf_ssd.tools.bench.runner import plan_methods

    names = [m.name for m in plan_methods(BenchConfig(tiny=True, methods=("plain", "auto:warmup"), compile="both"),
                                          [])]
    assert names == ["plain", "ssd:auto+warmup", "ssd:auto+warmup+compile"]
    with pytest.raises(ValueError, match="two benches"):
        plan_methods(BenchConfig(tiny=True, methods=("auto", "auto:warmup")), [])
    events = []
    monkeypatch.setattr(hf_ssd, "warmup", lambda target, draft, **kw: events.append(("warmup", target, draft, kw)))
    target, draft = object(), object()
    for option in ("warmup", None):
        m = SimpleNamespace(kind="auto", option=option, compiled=False, engine_compiled=False)
        _warm_up(m, ["batch"], lambda batch, max_new_tokens=None: events.append("call"),
                 BenchConfig(tiny=True, warmup=1, max_new_tokens=8), target, draft, SimpleNamespace(update=lambda: None))
    assert events[0] == ("warmup", target, draft, {"draft_process": True, "progress": False})
    assert events.count("call") >= 2 and sum(isinstance(e, tuple) for e in events) == 1
