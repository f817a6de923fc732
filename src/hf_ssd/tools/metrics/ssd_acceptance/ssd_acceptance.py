"""SSD acceptance: how many drafted tokens the target accepts per round, and how often the speculation cache hits.

One entry per generation (or per batch row): `accepted` drafted tokens accepted in total, `rounds` verification
rounds, `cache_hits` and `cache_lookups` of the speculation cache (0/0 for synchronous SD). Entries are pooled:
`mean_accepted = sum(accepted) / sum(rounds)` (accepted drafts per round, 0..K), `mean_tokens_per_round =
mean_accepted + 1` (the bonus token), `hit_rate = sum(cache_hits) / sum(cache_lookups)` (None without lookups).
`hf_ssd.tools.metrics.acceptance_inputs(stats)` turns `ssd_stats` dicts (from generate) into these columns.
"""
from __future__ import annotations

import datasets
import evaluate

_KWARGS_DESCRIPTION = """
Args:
    accepted: list of int, accepted draft tokens per generation (ssd_stats["per_row"]["accepted"]).
    rounds: list of int, verification rounds per generation.
    cache_hits: list of int, speculation-cache hits per generation.
    cache_lookups: list of int, speculation-cache lookups per generation.
Returns: mean_accepted, mean_tokens_per_round, hit_rate, rounds, per_generation_mean_accepted.
Examples:
    >>> m = evaluate.load("src/hf_ssd/tools/metrics/ssd_acceptance")
    >>> m.compute(accepted=[6, 2], rounds=[2, 2], cache_hits=[1, 2], cache_lookups=[2, 2])["mean_accepted"]
    2.0
"""


class SsdAcceptance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "accepted": datasets.Value("int64"),
                "rounds": datasets.Value("int64"),
                "cache_hits": datasets.Value("int64"),
                "cache_lookups": datasets.Value("int64"),
            }),
        )

    def _compute(self, accepted, rounds, cache_hits, cache_lookups):
        if any(r < 0 for r in rounds) or any(a < 0 for a in accepted):
            raise ValueError("accepted and rounds must be non-negative")
        if any(h > n for h, n in zip(cache_hits, cache_lookups)):
            raise ValueError("cache_hits cannot exceed cache_lookups")
        total_rounds, lookups = sum(rounds), sum(cache_lookups)
        mean = sum(accepted) / total_rounds if total_rounds else 0.0
        return {
            "mean_accepted": mean,
            "mean_tokens_per_round": mean + 1.0 if total_rounds else 0.0,
            "hit_rate": sum(cache_hits) / lookups if lookups else None,
            "rounds": total_rounds,
            "per_generation_mean_accepted": [a / r if r else 0.0 for a, r in zip(accepted, rounds)],
        }
