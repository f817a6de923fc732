"""SSD fidelity: is SSD's output the same as plain decoding's?

Two checks, chosen by the config name (`evaluate.load(path)` = "identity", `evaluate.load(path, "distribution")`):

* identity (greedy): `predictions[i]` and `references[i]` are the token ids SSD and plain decoding generated for
  prompt i. Returns `identity_rate` (fraction of exactly equal sequences; 1.0 for an exact method),
  `mean_matching_prefix` (fraction of the reference matched before the first difference) and `first_divergence`
  (index of the first differing token per pair, -1 when identical).
* distribution (T > 0): `predictions` are SSD samples and `references` plain samples, `groups[i]` (default: all 0)
  names the prompt sample i belongs to. For every (group, position) a chi-square test of homogeneity compares the
  token counts of the two samplers (tokens seen fewer than `min_count` times in total are pooled into one bin). The
  per-position p-values are combined with Bonferroni (valid under dependence): `p_value = min(1, n_tests * min p)`,
  `reject = p_value < alpha`. An exact sampler rejects with probability <= alpha.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import datasets
import evaluate
import numpy as np

_CITATION = """@inproceedings{kumar2026ssd, title={Speculative Speculative Decoding}, author={Kumar, Tanishq and Dao, Tri
and May, Avner}, booktitle={ICLR}, year={2026}}"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of token-id lists generated with SSD.
    references: list of token-id lists generated with plain decoding (same prompts / prompt groups).
    groups (distribution only): list of prompt ids, one per sample; default all samples share one prompt.
    alpha (distribution only): test level, default 0.01.
    min_count (distribution only): pool tokens seen fewer times than this (both samplers together), default 5.
    max_positions (distribution only): test only the first positions, default all.
Returns (identity): identity_rate, mean_matching_prefix, first_divergence.
Returns (distribution): p_value (Bonferroni-combined), min_p_value, n_tests, reject, p_values (per group, position).
Examples:
    >>> m = evaluate.load("src/hf_ssd/tools/metrics/ssd_fidelity")
    >>> m.compute(predictions=[[1, 2, 3]], references=[[1, 2, 3]])["identity_rate"]
    1.0
"""


class SsdFidelity(evaluate.Metric):

    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "predictions": datasets.Sequence(datasets.Value("int64")),
                "references": datasets.Sequence(datasets.Value("int64")),
            }),
        )

    def _compute(self, predictions, references, groups=None, alpha=0.01, min_count=5, max_positions=None):
        mode = self.config_name if self.config_name in ("identity", "distribution") else "identity"
        if mode == "identity":
            return identity(predictions, references)
        return distribution_test(predictions, references, groups, alpha, min_count, max_positions)


def identity(predictions, references):
    if len(predictions) == 0:
        raise ValueError("no sequences given")
    same, prefix, first = 0, [], []
    for p, r in zip(predictions, references):
        p, r = list(p), list(r)
        n = 0
        while n < min(len(p), len(r)) and p[n] == r[n]:
            n += 1
        equal = p == r
        same += equal
        first.append(-1 if equal else n)
        prefix.append(1.0 if equal else n / max(len(r), 1))
    return {"identity_rate": same / len(predictions), "mean_matching_prefix": float(np.mean(prefix)),
            "first_divergence": first}


def _chi2_homogeneity(a: Counter, b: Counter, min_count: int) -> float | None:
    from scipy.stats import chi2_contingency

    total = a + b
    keep = [t for t, c in total.items() if c >= min_count]
    rare = [t for t in total if t not in keep]
    rows = [[a[t] for t in keep], [b[t] for t in keep]]
    if rare:
        rows[0].append(sum(a[t] for t in rare))
        rows[1].append(sum(b[t] for t in rare))
    table = np.array(rows, dtype=float)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2 or (table.sum(1) == 0).any():
        return None  # one category only (or one side empty): nothing to test
    return float(chi2_contingency(table, correction=False).pvalue)


def distribution_test(predictions, references, groups=None, alpha=0.01, min_count=5, max_positions=None):
    if groups is None:
        groups = [0] * len(predictions)
    if len(groups) != len(predictions):
        raise ValueError("groups needs one entry per sample")
    end = "<end>"  # a sequence that stopped early contributes this symbol at later positions
    counts: dict[tuple, list[Counter]] = defaultdict(lambda: [Counter(), Counter()])
    longest = max(len(s) for s in list(predictions) + list(references))
    horizon = longest if max_positions is None else min(longest, max_positions)
    for side, samples in ((0, predictions), (1, references)):
        for g, seq in zip(groups, samples):
            seq = list(seq)
            for t in range(horizon):
                counts[(g, t)][side][seq[t] if t < len(seq) else end] += 1
    p_values = {}
    for key, (a, b) in counts.items():
        p = _chi2_homogeneity(a, b, min_count)
        if p is not None:
            p_values[key] = p
    if not p_values:
        return {"p_value": 1.0, "min_p_value": 1.0, "n_tests": 0, "reject": False, "p_values": []}
    n = len(p_values)
    pmin = min(p_values.values())
    combined = min(1.0, n * pmin)
    return {"p_value": combined, "min_p_value": pmin, "n_tests": n, "reject": bool(combined < alpha),
            "p_values": [[str(g), t, p] for (g, t), p in sorted(p_values.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))]}
