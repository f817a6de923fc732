"""Fuzzing the public surface: random valid and invalid `ssd_*` options and generate() keywords (seeded).

Every case either raises ValueError/TypeError whose message names the offending option, or returns exactly plain
greedy generate()'s output (sampled cases: a well-formed output), each within a bounded time.
"""
from __future__ import annotations

import math
import random
import time
import warnings

import pytest
import torch

from hf_ssd.testing import PAD, VOCAB, get_pair, plain_generate

CASES = 100
SECONDS_PER_CASE = 20.0
NAN, INF = float("nan"), float("inf")

# option -> (valid values, invalid values). Combinations are kept valid in `make_case` (fanout length = K+1, no
# worker other than auto/inline with mode="sync"), so a case is invalid exactly when it draws an invalid value.
OPTIONS = {
    "mode": (["auto", "ssd", "sync"], ["fast", 1, None]),
    "num_draft_tokens": ([1, 2, 3, 4, 8], [0, 65, 2.0, "3", True, -1]),
    "budget": ([None, 1, 4, 6, 64, 4096], [0, -3, 4097, 10**9, 2.5, "8", NAN]),
    "alpha": ([None, 0.3, 0.9], [0.0, 1.0, NAN, "0.5", 2]),
    "power_r": ([None, 0.5, 2.0], [0, -1.0, INF, NAN]),
    "downweight": ([0.0, 0.5, 1.0, 1], ["0.5", NAN, 1.5, -0.1, None]),
    "backup": (["auto", "jit", "ngram"], ["fast", None]),
    "backup_batch_threshold": ([None, 1, 4], [0, NAN, 2.5, "4"]),
    "ngram_max": ([1, 3], [0, 1.0, None]),
    "draft_temperature": ([None, 0.5, 1.0], [0, -1.0, INF, "1"]),
    "worker": (["auto", "inline", "thread"], ["gpu", 3, None]),
    "draft_device": ([None, "cpu"], ["meta", "nowhere", 3]),
    "draft_quantize": ([None, "int8", "auto"], ["int4", 8]),
    "draft_threads": ([None, 1], [0, 1.5, "2"]),
    "target_threads": ([None, 1], [0, 1.5, "2"]),
    "trust_processors": ([False, True], ["yes", 1]),
}
# Valid values that spell out a whole plan (no start-up measurement): the SSD engine itself, on every worker.
PINNED = {"mode": ["ssd", "ssd", "sync"], "num_draft_tokens": [1, 2, 3, 4, 8], "budget": [1, 4, 6, 64, 4096],
          "draft_quantize": [None, None, "int8"], "worker": ["inline", "thread", "thread"]}
# generate() keywords SSD refuses (name, kwargs); each error must name the keyword.
BAD_GENERATE = [
    ("num_beams", dict(num_beams=2)),
    ("penalty_alpha", dict(penalty_alpha=0.5, top_k=4)),
    ("dola_layers", dict(dola_layers="low")),
    ("attention_mask", dict(attention_mask="wrong shape")),
    ("assistant_model", dict(assistant_model="foo")),
    ("ssd_budgett", dict(ssd_budgett=4)),
    ("ssd_fanout", dict(ssd_fanout=[1, 1])),  # wrong length for any K >= 2 (K is set to 3 below)
]


def make_case(i: int) -> dict:
    rng = random.Random(1000 + i)
    case = {"arch": rng.choice(["llama", "llama", "gpt2", "qwen3"]), "batch": rng.choice([1, 1, 2]),
            "prompt_len": rng.randint(3, 9), "new": rng.randint(1, 12), "sample": rng.random() < 0.15,
            "processors": rng.random() < 0.3, "options": {}, "extra": {}, "bad": None}
    names = rng.sample(sorted(OPTIONS), rng.randint(0, 6))
    pin = rng.random() < 0.5  # half the runs pin the engine (a fixed plan) rather than leave it to the controller
    if pin:
        names = sorted(set(names) | set(PINNED))
    invalid = None
    roll = rng.random()
    if roll < 0.25 and names:
        invalid = rng.choice(names)
    elif roll < 0.37:
        bad_name, bad_kw = BAD_GENERATE[i % len(BAD_GENERATE)]
        case["bad"], case["extra"] = bad_name, dict(bad_kw)
        if bad_name == "ssd_fanout":
            case["options"]["num_draft_tokens"] = 3
            names = [n for n in names if n != "num_draft_tokens"]
    for name in names:
        valid, wrong = OPTIONS[name]
        if pin and name in PINNED:
            valid = PINNED[name]
        case["options"][name] = rng.choice(wrong if name == invalid else valid)
    opts = case["options"]
    if invalid is not None:
        case["bad"] = f"ssd_{invalid}"
    # keep the valid combinations valid
    if opts.get("mode") == "sync" and invalid != "worker" and opts.get("worker") not in (None, "auto", "inline"):
        opts["worker"] = rng.choice(["auto", "inline"])
    K = opts.get("num_draft_tokens")
    if isinstance(K, int) and not isinstance(K, bool) and 1 <= K <= 64 and invalid is None and case["bad"] is None:
        if rng.random() < 0.3:
            opts["fanout"] = [rng.randint(0, 3) for _ in range(K + 1)]
    return case


def _same_value(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("i", range(CASES))
def test_fuzz_case(i):
    case = make_case(i)
    p = get_pair(case["arch"])
    g = torch.Generator().manual_seed(i)
    B, P = case["batch"], case["prompt_len"]
    ids = torch.randint(2, VOCAB - 1, (B, P), generator=g)
    mask = torch.ones_like(ids)
    if B > 1:
        mask[1, : P // 2] = 0
        ids[1, : P // 2] = PAD
    kw = dict(attention_mask=mask, max_new_tokens=case["new"], pad_token_id=PAD, do_sample=case["sample"])
    if case["processors"]:
        kw.update(repetition_penalty=1.3, no_repeat_ngram_size=3)
    ssd_kw = {f"ssd_{k}": v for k, v in case["options"].items()}
    extra = dict(case["extra"])
    draft = extra.pop("assistant_model", p.related)
    if extra.get("attention_mask") == "wrong shape":
        extra["attention_mask"] = mask[:, 1:]
    call = {**kw, **ssd_kw, **extra}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.no_grad():
                out = p.target.generate(ids, assistant_model=draft, ssd=True,
                                        generator=torch.Generator().manual_seed(i), **call)
            error = None
        except (ValueError, TypeError) as exc:
            error = exc
    elapsed = time.perf_counter() - start
    assert elapsed < SECONDS_PER_CASE, (case, elapsed)
    if case["bad"] is not None:
        assert error is not None, f"case {i} should have been refused: {case}"
        assert case["bad"] in str(error), (case, str(error))
        return
    assert error is None, f"case {i} was refused: {case}: {error}"
    if case["sample"]:
        assert out.shape[0] == B and P < out.shape[1] <= P + case["new"]
        assert int(out.min()) >= 0 and int(out.max()) < VOCAB
        return
    ref = plain_generate(p.target, ids, **kw)
    assert torch.equal(out, ref), case


def test_cases_cover_both_outcomes():
    cases = [make_case(i) for i in range(CASES)]
    refused = sum(c["bad"] is not None for c in cases)
    assert 15 <= refused <= CASES // 2, refused
    fixed = [c for c in cases if c["bad"] is None and c["options"].get("mode") == "ssd"
             and c["options"].get("budget") is not None and c["options"].get("draft_quantize") != "auto"]
    assert len(fixed) >= 8, len(fixed)
    assert len({c["bad"] for c in cases if c["bad"] and not c["bad"].startswith("ssd_")}) >= 4
    assert not any(_same_value(c["options"].get("budget"), NAN) and c["bad"] is None for c in cases)
