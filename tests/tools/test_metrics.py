"""evaluate metric modules loaded from local paths: known values on constructed inputs."""
from __future__ import annotations

import numpy as np
import pytest

from hf_ssd.tools import metrics


@pytest.fixture(scope="module")
def identity():
    return metrics.load("ssd_fidelity")


@pytest.fixture(scope="module")
def distribution():
    return metrics.load("ssd_fidelity", "distribution")


def test_loaded_by_evaluate_from_local_path():
    import evaluate

    m = evaluate.load(metrics.path("ssd_acceptance"))
    assert m.name == "ssd_acceptance"
    with pytest.raises(KeyError):
        metrics.path("bleu")


def test_identity_rate(identity):
    seqs = [[1, 2, 3, 4], [5, 6], [7]]
    r = identity.compute(predictions=seqs, references=seqs)
    assert r["identity_rate"] == 1.0 and r["mean_matching_prefix"] == 1.0 and r["first_divergence"] == [-1] * 3
    changed = [[1, 2, 9, 4], [5, 6], [7, 8]]  # a changed token, an extra token
    r = identity.compute(predictions=changed, references=seqs)
    assert r["identity_rate"] == pytest.approx(1 / 3)
    assert r["first_divergence"] == [2, -1, 1]
    assert r["mean_matching_prefix"] == pytest.approx((0.5 + 1 + 1) / 3)


def _sampler(probs, n, length, seed):
    return np.random.default_rng(seed).choice(len(probs), size=(n, length), p=probs).tolist()


def test_distribution_accepts_same_sampler(distribution):
    p = [0.5, 0.2, 0.15, 0.1, 0.05]
    r = distribution.compute(predictions=_sampler(p, 400, 4, 1), references=_sampler(p, 400, 4, 2), alpha=0.01)
    assert r["n_tests"] == 4 and not r["reject"] and r["p_value"] > 0.01


def test_distribution_rejects_biased_sampler(distribution):
    p = [0.5, 0.2, 0.15, 0.1, 0.05]
    biased = [0.4, 0.3, 0.15, 0.1, 0.05]  # 10 points of mass moved from token 0 to token 1
    r = distribution.compute(predictions=_sampler(biased, 1500, 3, 1), references=_sampler(p, 1500, 3, 2))
    assert r["reject"] and r["p_value"] < 1e-3
    greedy_like = [[0, 0, 0]] * 300  # a sampler that degenerated to argmax
    r = distribution.compute(predictions=greedy_like, references=_sampler(p, 300, 3, 3))
    assert r["reject"]


def test_distribution_groups_and_lengths(distribution):
    a = [[0, 1], [0], [1, 1], [1]] * 50
    r = distribution.compute(predictions=a, references=list(a), groups=[0, 0, 1, 1] * 50)
    assert r["p_value"] == 1.0 and not r["reject"]
    assert {g for g, _, _ in r["p_values"]} <= {"0", "1"}


def test_acceptance_known_values():
    m = metrics.load("ssd_acceptance")
    r = m.compute(accepted=[6, 2], rounds=[2, 2], cache_hits=[1, 2], cache_lookups=[2, 2])
    assert r["mean_accepted"] == 2.0 and r["mean_tokens_per_round"] == 3.0 and r["hit_rate"] == 0.75
    assert r["per_generation_mean_accepted"] == [3.0, 1.0]
    r = m.compute(accepted=[3], rounds=[3], cache_hits=[0], cache_lookups=[0])
    assert r["hit_rate"] is None and r["mean_accepted"] == 1.0
    with pytest.raises(ValueError, match="cannot exceed"):
        m.compute(accepted=[1], rounds=[1], cache_hits=[2], cache_lookups=[1])


def test_acceptance_inputs_from_generate_stats():
    import torch

    from hf_ssd.testing import tiny_pair

    target, draft, tok = tiny_pair()
    enc = tok(["ab", "hello"], return_tensors="pt", padding=True)
    # a fixed SSD plan: the controller may pick plain decoding for a tiny pair (no rounds to measure)
    out = target.generate(**enc, assistant_model=draft, ssd=True, max_new_tokens=10, do_sample=False,
                          return_dict_in_generate=True, ssd_mode="ssd", ssd_num_draft_tokens=4, ssd_budget=6,
                          ssd_draft_quantize=None)
    cols = metrics.acceptance_inputs([out.ssd_stats])
    assert len(cols["rounds"]) == 2
    r = metrics.load("ssd_acceptance").compute(**cols)
    s = out.ssd_stats
    assert r["mean_accepted"] == pytest.approx(sum(s["per_row"]["accepted"]) / sum(s["per_row"]["rounds"]))
    assert 0.0 <= (r["hit_rate"] or 0.0) <= 1.0
    assert isinstance(out.sequences, torch.Tensor)
