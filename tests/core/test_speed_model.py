"""Speed model (docs/algorithm.md §6): hand-computed values, b* behaviour, and predicted tokens/s."""
from __future__ import annotations

import numpy as np
import pytest

from hf_ssd.core.speed_model import (
    AR_SPEEDUP,
    RoundTimings,
    backup_threshold,
    batch_hit_rate,
    expected_tokens_per_round,
    predict,
    sd_speedup,
    ssd_speedup,
)


def test_ssd_speedup_by_hand():
    # [0.8·4 + 0.2·3] / [0.8·max(1, 0.5) + 0.2·(1 + 0.6)] = 3.8 / 1.12
    assert ssd_speedup(0.8, 4.0, 3.0, 0.5, 0.6) == pytest.approx(3.8 / 1.12)
    assert ssd_speedup(1.0, 4.0, 1.0, 2.0, 9.0) == pytest.approx(2.0)  # tree slower than verify bounds the round
    assert ssd_speedup(0.0, 4.0, 2.0, 0.5, 1.0) == pytest.approx(1.0)  # always JIT: like SD with t_draft = 1
    assert ssd_speedup(0.9, 4.0, 3.0, 0.5, 1.0, batch=2) == pytest.approx(3.9 / (0.81 + 0.19 * 2.0))
    assert ssd_speedup(1.0, 4.0, 1.0, 0.5, 1.0, t_sync=0.25) == pytest.approx(4.0 / 1.25)
    with pytest.raises(ValueError):
        ssd_speedup(1.5, 4.0, 3.0, 0.5, 0.6)


def test_sd_ar_and_batch_hit_rate():
    assert sd_speedup(4.0, 0.5) == pytest.approx(4.0 / 1.5)
    assert AR_SPEEDUP == 1.0
    assert batch_hit_rate(0.9, 2) == pytest.approx(0.81)
    assert batch_hit_rate(0.9, 1) == pytest.approx(0.9)


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.5, 3) == pytest.approx(1.875)  # 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens_per_round(1.0, 7) == 8.0
    assert expected_tokens_per_round(0.0, 7) == 1.0
    rng = np.random.default_rng(0)  # Monte Carlo: accepted (capped geometric) + 1 bonus
    trials = rng.random((200_000, 5)) < 0.7
    accepted = np.where(trials.all(1), 5, np.argmin(trials, axis=1))
    assert (accepted + 1).mean() == pytest.approx(expected_tokens_per_round(0.7, 5), abs=0.01)
    with pytest.raises(ValueError):
        expected_tokens_per_round(1.2, 3)


def test_backup_threshold_by_hand():
    # JIT: 4.0 / (P + 1.25(1-P)); fast: 3.7 / 1. Fast wins iff P_b < 0.675676: 0.9^3 = 0.729, 0.9^4 = 0.6561
    kw = dict(t_tree=0.5, t_jit=0.25, t_fast=0.0, e_hit=4.0, e_miss_jit=4.0, e_miss_fast=1.0)
    assert backup_threshold(0.9, **kw) == 4
    assert ssd_speedup(0.9, 4.0, 4.0, 0.5, 0.25, batch=3) > ssd_speedup(0.9, 4.0, 1.0, 0.5, 0.0, batch=3)
    assert backup_threshold(1.0, **kw) == 1025  # never: a batch that always hits never waits on a backup
    assert backup_threshold(1.0, **kw, max_batch=8) == 9
    # every round misses: JIT 4.0 / 1.25 = 3.2 beats fast 1.0 / 1 at every b
    assert backup_threshold(0.0, **kw) == 1025


def test_backup_threshold_monotone_in_p_hit():
    # (1-p^b)/(1-p) grows with p: the stall cost rises relative to JIT's gain, so b* is non-increasing in p_hit
    kw = dict(t_tree=0.7, t_jit=0.6, t_fast=0.02, e_hit=4.5, e_miss_jit=4.0, e_miss_fast=1.6)
    b = [backup_threshold(p, **kw) for p in np.linspace(0.0, 0.999, 60)]
    assert all(x >= y for x, y in zip(b, b[1:])), b
    assert b[0] == 1025 and b[-1] == 1 and len(set(b)) > 3
    # a costlier JIT backup switches no later; a better JIT proposal switches no earlier
    for p in (0.4, 0.6, 0.9):
        assert backup_threshold(p, **{**kw, "t_jit": 1.5}) <= backup_threshold(p, **kw)
        assert backup_threshold(p, **{**kw, "e_miss_jit": 4.4}) >= backup_threshold(p, **kw)
    # brute force: b* is where the two speedups cross
    bs = backup_threshold(0.4, **kw)
    assert 1 < bs < 1025
    jit = lambda b: ssd_speedup(0.4, 4.5, 4.0, 0.7, 0.6, batch=b)
    fast = lambda b: ssd_speedup(0.4, 4.5, 1.6, 0.7, 0.02, batch=b)
    assert fast(bs) > jit(bs) and fast(bs - 1) <= jit(bs - 1)


def test_backup_threshold_equals_a_scan_of_every_batch():
    # the bisection against the first b whose fast backup wins, over random estimates (incl. a better or slower fast)
    rng = np.random.default_rng(1)
    for _ in range(300):
        kw = dict(t_tree=rng.uniform(0.1, 2.0), t_jit=rng.uniform(0.0, 2.0), t_fast=rng.uniform(0.0, 1.0),
                  e_hit=rng.uniform(1.0, 9.0), e_miss_jit=rng.uniform(1.0, 9.0), e_miss_fast=rng.uniform(1.0, 9.0))
        p = float(rng.choice([0.0, 1.0, rng.uniform(0.0, 1.0), rng.uniform(0.95, 1.0)]))
        scan = next((b for b in range(1, 201)
                     if ssd_speedup(p, kw["e_hit"], kw["e_miss_fast"], kw["t_tree"], kw["t_fast"], batch=b)
                     > ssd_speedup(p, kw["e_hit"], kw["e_miss_jit"], kw["t_tree"], kw["t_jit"], batch=b)), 201)
        assert backup_threshold(p, **kw, max_batch=200) == scan, (p, kw)


def test_predict_by_hand():
    t = RoundTimings(verify_s=0.02, tree_s=0.01, draft_step_s=0.002, backup_s=0.01, ar_step_s=0.02)
    pr = predict(t, K=4, alpha=0.5, p_hit=0.8)
    e = 1.9375  # (1 - 0.5^5) / 0.5
    assert pr.ar_tps == pytest.approx(50.0)
    assert pr.sd_tps == pytest.approx(e / 0.028)
    assert pr.ssd_tps == pytest.approx(e / (0.8 * 0.02 + 0.2 * 0.03))
    assert pr.ssd_speedup == pytest.approx(ssd_speedup(0.8, e, e, 0.5, 0.5))  # ar_step = verify: same units
    assert pr.sd_speedup == pytest.approx(sd_speedup(e, 0.4))
    assert pr.ssd_over_sd == pytest.approx(pr.ssd_tps / pr.sd_tps)
    # batch: tokens scale with rows; a round stalls unless every row hits
    pb = predict(t, K=4, e_hit=3.0, e_miss=2.0, p_hit=0.9, batch=4)
    assert pb.ssd_tps == pytest.approx(4 * (0.9 * 3 + 0.1 * 2) / (0.9**4 * 0.02 + (1 - 0.9**4) * 0.03))
    assert pb.ar_tps == pytest.approx(200.0)
    with pytest.raises(ValueError):
        predict(t, K=4, p_hit=0.5)


def test_a_tree_slower_than_the_verify_is_paid_in_miss_rounds_too():
    # the miss is known only after both the verify and the tree: a miss round costs max(1, T_tree) + T_backup
    assert ssd_speedup(0.5, 5.0, 3.0, 1.5, 1.0) == pytest.approx(4.0 / (1.5 + 0.5 * 1.0))
    # with T_tree <= 1 it is the paper's p·max(1, T_tree) + (1-p)·(1 + T_backup)
    p, t_tree, t_backup = 0.7, 0.8, 0.6
    assert ssd_speedup(p, 5.0, 3.0, t_tree, t_backup) == pytest.approx(
        (p * 5.0 + (1 - p) * 3.0) / (p * max(1, t_tree) + (1 - p) * (1 + t_backup)))
