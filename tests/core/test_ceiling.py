"""The upper bound on SSD's gain over synchronous SD (hf_ssd.core.ceiling), against hand-computed cases."""
import pytest

from hf_ssd.core.ceiling import best_sd, best_ssd, break_even_hit_rate, ceiling_rows


def test_best_sd_at_alpha_one_drafts_the_most_tokens_it_may():
    # α = 1: K drafts + the bonus per round of one verify + K draft forwards; more K always pays
    speed, K = best_sd(1.0, 0.29, max_K=8)
    assert K == 8
    assert speed == pytest.approx(9 / (1 + 8 * 0.29))


def test_best_ssd_with_a_perfect_cache_hides_the_tree_up_to_one_verify():
    # α = 1, draft 0.29 verify: K = 4 trees cost 1.16 verifies (the first past 1), 5 tokens a round
    speed, K = best_ssd(1.0, 0.29, p_hit=1.0, max_K=8)
    assert K == 4
    assert speed == pytest.approx(5 / (4 * 0.29))


def test_a_missing_cache_commits_the_bonus_alone():
    speed, _ = best_ssd(0.7, 0.29, p_hit=0.0)
    assert speed == pytest.approx(1.0)  # one token per verify: plain decoding, never better


def test_ssd_speed_rises_with_the_hit_rate():
    speeds = [best_ssd(0.8, 0.29, p)[0] for p in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert speeds == sorted(speeds) and speeds[0] < speeds[-1]


def test_break_even_hit_rate_is_where_ssd_meets_the_ratio():
    p = break_even_hit_rate(0.7, 0.29, ratio=1.2)
    assert 0 < p < 1
    goal = 1.2 * best_sd(0.7, 0.29)[0]
    assert best_ssd(0.7, 0.29, p)[0] == pytest.approx(goal, rel=1e-6)
    assert best_ssd(0.7, 0.29, p - 0.01)[0] < goal


def test_a_ratio_beyond_a_perfect_cache_is_unreachable():
    assert break_even_hit_rate(1.0, 0.29, ratio=2.0) is None


def test_ceiling_rows_cover_every_cost_and_alpha():
    rows = ceiling_rows(alphas=(1.0, 0.7), draft_costs=(0.29,), hit_rates=(1.0, 0.5))
    assert [(r["draft_cost"], r["alpha"]) for r in rows] == [(0.29, 1.0), (0.29, 0.7)]
    for r in rows:
        assert r["ssd_over_sd"][1.0] > r["ssd_over_sd"][0.5]
