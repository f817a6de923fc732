"""T > 0: the distribution of SSD's output sequences equals the target's, checked statistically.

A tiny model over V=4 tokens generates L=3 tokens. The exact target distribution over all V^L sequences is
computed by enumeration (softmax of the target's warped logits along every prefix, with the same warpers as
generate()). Then N rows of the same prompt go through generate(ssd=True) as one batch and a chi-square test
compares the counts with the exact probabilities. Cells with small expectation are pooled.

Power: at N = 16000 the check rejects a distribution that moves 1% of probability mass between two typical cells
(see `test_check_detects_one_percent_bias`), and every deliberately biased sampler below (wrong q, greedy matching
of n-gram drafts at T > 0) fails it. Everything is seeded, so results are reproducible; the false-alarm level per
test is 1e-3.
"""
from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_ssd.draft.model as draft_mod
import hf_ssd.runtime.engine as engine_mod
import hf_ssd.runtime.prefill as prefill_mod
from hf_ssd.core.sampling import sample, saguaro_probs
from hf_ssd.core.verify import verify_sampled
from hf_ssd.testing import noisy_copy, tiny_llama

V = 4
L = 3
N = 16000
ALPHA = 1e-3  # false-alarm level per check

PROMPT_A = torch.tensor([[1, 2, 3, 1, 2, 3, 1]])  # repetitive: the n-gram backup finds proposals
PROMPT_B = torch.tensor([[3, 0, 2, 2]])


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(3, vocab_size=V, num_hidden_layers=1, max_position_embeddings=64, initializer_range=0.08,
                        bos_token_id=None, eos_token_id=None)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    draft = noisy_copy(target, 0.6, seed=7)
    return target, draft


def warpers(temperature=1.0, top_k=None, top_p=None, repetition_penalty=None) -> LogitsProcessorList:
    """The processors and warpers generate() builds, in its order."""
    out = LogitsProcessorList()
    if repetition_penalty is not None:
        out.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        out.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        out.append(TopPLogitsWarper(top_p))
    return out


@torch.no_grad()
def exact_distribution(model, prompt: torch.Tensor, procs: LogitsProcessorList) -> np.ndarray:
    """P(y_1..y_L | prompt) for all V^L sequences (row-major), by enumeration of prefixes."""
    probs = np.ones([V] * L)
    for j in range(L):
        prefixes = list(itertools.product(range(V), repeat=j))
        ids = torch.cat([prompt.repeat(len(prefixes), 1), torch.tensor(prefixes, dtype=torch.long).reshape(len(prefixes), j)], 1)
        logits = model(ids).logits[:, -1].float()
        p = torch.softmax(procs(ids, logits), -1).double().numpy()
        for pre, row in zip(prefixes, p):
            probs[pre] *= row.reshape([V] + [1] * (L - j - 1))
    return probs.reshape(-1)


def counts_of(gen: torch.Tensor) -> np.ndarray:
    assert gen.shape[1] == L and int(gen.min()) >= 0 and int(gen.max()) < V
    index = (gen * torch.tensor([V ** (L - 1 - i) for i in range(L)])).sum(1)
    return np.bincount(index.numpy(), minlength=V**L)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square with cells of expectation < 5 pooled; returns (statistic, degrees of freedom)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a sequence of probability 0 was generated"
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum() - 1)


def p_value(groups: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Combined chi-square p-value over independent groups (counts, exact probs)."""
    total, df = 0.0, 0
    for counts, probs in groups:
        s, d = chi_square(counts, probs)
        total, df = total + s, df + d
    return float(stats.chi2.sf(total, df))


def tv(counts, probs) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def run_ssd(target, draft, prompts: list[torch.Tensor], seed: int, warp: dict, **ssd):
    """N rows split evenly over `prompts` (left-padded), one generate(ssd=True) call; returns per-prompt counts."""
    per = N // len(prompts)
    P = max(p.shape[1] for p in prompts)
    ids = torch.zeros(per * len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, pr in enumerate(prompts):
        ids[i * per:(i + 1) * per, P - pr.shape[1]:] = pr
        mask[i * per:(i + 1) * per, P - pr.shape[1]:] = 1
    ssd.setdefault("ssd_budget", 4)
    with torch.no_grad():
        out = target.generate(
            ids, attention_mask=mask, assistant_model=draft, ssd=True, do_sample=True, max_new_tokens=L,
            pad_token_id=0, generator=torch.Generator().manual_seed(seed), return_dict_in_generate=True,
            top_k=warp.get("top_k", 0), top_p=warp.get("top_p", 1.0), temperature=warp.get("temperature", 1.0),
            repetition_penalty=warp.get("repetition_penalty"), **ssd,
        )
    gen = out.sequences[:, P:]
    return [counts_of(gen[i * per:(i + 1) * per]) for i in range(len(prompts))], out.ssd_stats


def check(models, prompts, seed, warp, **ssd):
    ssd = {"ssd_mode": "ssd", "ssd_draft_quantize": None, **ssd}  # the engine under test, not the controller's pick
    target, draft = models
    procs = warpers(**warp)
    counts, s = run_ssd(target, draft, prompts, seed, warp, **ssd)
    probs = [exact_distribution(target, p, procs) for p in prompts]
    pv = p_value(list(zip(counts, probs)))
    return pv, [tv(c, p) for c, p in zip(counts, probs)], s


CASES = {
    "sync": dict(warp=dict(), ssd=dict(ssd_mode="sync", ssd_num_draft_tokens=2)),
    "ssd_C1": dict(warp=dict(), ssd=dict(ssd_num_draft_tokens=1, ssd_fanout=[2, 1], ssd_backup="jit")),
    "ssd_C03": dict(warp=dict(), ssd=dict(ssd_num_draft_tokens=1, ssd_fanout=[1, 2], ssd_downweight=0.3)),
    "ssd_C0_K2": dict(warp=dict(temperature=1.3), ssd=dict(ssd_num_draft_tokens=2, ssd_fanout=[1, 1, 2],
                                                           ssd_downweight=0.0, ssd_backup="jit")),
    "jit_topk": dict(warp=dict(temperature=0.8, top_k=3), ssd=dict(ssd_num_draft_tokens=2, ssd_fanout=[0, 1, 1],
                                                                   ssd_backup="jit", ssd_downweight=0.5)),
    # miss-only: the n-gram backup (point masses) serves every round after the first
    "ngram": dict(warp=dict(), ssd=dict(ssd_num_draft_tokens=1, ssd_fanout=[0, 0], ssd_backup="ngram")),
    "draft_temp_topp": dict(warp=dict(temperature=0.7, top_p=0.9),
                            ssd=dict(ssd_num_draft_tokens=2, ssd_draft_temperature=1.6, ssd_fanout=[1, 1, 1])),
    # input-dependent processor at T > 0: each position's penalty follows its own prefix (drafts included)
    "ssd_repetition_penalty": dict(warp=dict(repetition_penalty=1.8),
                                   ssd=dict(ssd_num_draft_tokens=2, ssd_fanout=[1, 1, 1], ssd_downweight=0.5)),
    "sync_topk_topp": dict(warp=dict(temperature=1.2, top_k=3, top_p=0.85),
                           ssd=dict(ssd_mode="sync", ssd_num_draft_tokens=1, ssd_draft_temperature=0.9)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_output_distribution_is_exact(models, name):
    case = CASES[name]
    prompts = [PROMPT_A] if name != "ssd_C03" else [PROMPT_A, PROMPT_B]  # C03 doubles as the mixed-batch case
    pv, tvs, s = check(models, prompts, seed=list(CASES).index(name), warp=case["warp"], **case["ssd"])
    assert pv > ALPHA, f"{name}: p={pv:.2e} tv={tvs} stats={s}"
    # the draft side really ran (non-trivial acceptance) and, for SSD, the cache and the backups were used
    assert 0 < s["mean_accepted"] < case["ssd"]["ssd_num_draft_tokens"], s
    if case["ssd"].get("ssd_mode") != "sync":
        if sum(case["ssd"]["ssd_fanout"]) > 0:
            assert 0 < s["cache_hits"] < s["cache_lookups"], s
        else:
            assert s["cache_hits"] == 0 < s["cache_lookups"], s
        backup = case["ssd"].get("ssd_backup")
        if backup is not None:
            assert set(s["backup_rounds"]) == {backup}, s



@pytest.mark.parametrize("name", ["ssd_C03", "sync_topk_topp"])
def test_output_distribution_is_exact_with_the_packed_kernel(models, monkeypatch, pack_everything, name):
    """Every float32 Linear of both models through the packed few-row kernel (kernels/packed_linear; the tiny
    models' weights are far below its size threshold, so it is forced): the law is still the target's."""
    from hf_ssd.kernels import packed_linear as pl

    monkeypatch.setattr(pl, "MAX_ROWS", 1 << 30)  # one batch of N rows: far more rows than a real call's
    case = CASES[name]
    prompts = [PROMPT_A, PROMPT_B] if name == "ssd_C03" else [PROMPT_A]
    pv, tvs, s = check(models, prompts, seed=40 + list(CASES).index(name), warp=case["warp"],
                       ssd_packed_linear=True, **case["ssd"])
    assert pv > ALPHA, f"{name}: p={pv:.2e} tv={tvs} stats={s}"
    assert pack_everything["n"] > 0 and 0 < s["mean_accepted"], s


# The static drafter carrying the tree over (draft.static_saguaro): forced on every round it can (the first included),
# eager static cache, L = 4 tokens: a delayed branch's speculation (K - 1 drafts, after a round that accepted all)
# is verified while the row still has tokens to make.
REUSE_CASES = {
    "reuse_C05": dict(warp=dict(), ssd=dict(ssd_num_draft_tokens=2, ssd_fanout=[1, 1, 2], ssd_downweight=0.5)),
    "reuse_topk_delayed": dict(warp=dict(temperature=0.8, top_k=3),
                               ssd=dict(ssd_num_draft_tokens=2, ssd_fanout=[2, 0, 2])),
}


@pytest.mark.parametrize("name", list(REUSE_CASES))
def test_output_distribution_is_exact_with_the_tree_carried_over(models, monkeypatch, name):
    from hf_ssd.draft.static_saguaro import StaticSaguaroDrafter
    from hf_ssd.runtime import static_kv

    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)
    monkeypatch.setattr(StaticSaguaroDrafter, "_reuse_pays", lambda self: True)
    monkeypatch.setattr(sys.modules[__name__], "L", 4)
    case = REUSE_CASES[name]
    pv, tvs, s = check(models, [PROMPT_A], seed=20 + list(REUSE_CASES).index(name), warp=case["warp"],
                       ssd_compile=True, ssd_backup="jit", **case["ssd"])
    assert pv > ALPHA, f"{name}: p={pv:.2e} tv={tvs} stats={s}"
    assert s["draft_static"] and s["tree_reused"] > 0 and s["fallback_reason"] is None, s
    assert 0 < s["cache_hits"] < s["cache_lookups"], s


def test_a_carried_over_tree_with_wrong_q_is_rejected(models, monkeypatch):
    """Negative control for the cases above: the drafts of delayed branches (the ones a carried-over tree starts a
    step late) reported with a q they were not drawn from is a biased sampler, and the check catches it."""
    from hf_ssd.draft.static_saguaro import StaticSaguaroDrafter
    from hf_ssd.runtime import static_kv

    finish = StaticSaguaroDrafter._finish_tree

    def misaligned(self, forks, steps, delayed):
        finish(self, forks, steps, delayed)
        if delayed is not None and not self.greedy:
            self.cache.q[delayed] = torch.full_like(self.cache.q[delayed], 1.0 / self.cache.q.shape[-1])

    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)
    monkeypatch.setattr(StaticSaguaroDrafter, "_reuse_pays", lambda self: True)
    monkeypatch.setattr(StaticSaguaroDrafter, "_finish_tree", misaligned)
    monkeypatch.setattr(sys.modules[__name__], "L", 4)
    case = REUSE_CASES["reuse_topk_delayed"]
    pv, tvs, s = check(models, [PROMPT_A], seed=21, warp=case["warp"], ssd_compile=True, ssd_backup="jit",
                       **case["ssd"])
    assert pv < ALPHA, f"the check failed to reject misaligned q (p={pv:.3f}, tv={tvs})"


@pytest.mark.parametrize("grouped", [False, True], ids=["padded prefill", "grouped prefill"])
def test_mixed_batch_rows_with_different_prompts(models, monkeypatch, grouped):
    """Rows of the same batch with different prompts (left padding) each follow their own exact distribution, also
    where each prompt's rows are prefilled apart (runtime.prefill)."""
    monkeypatch.setattr(prefill_mod, "GROUPED_AT_MOST", 1.0 if grouped else 0.0)  # 0: never groups
    calls = []
    real = prefill_mod.padding_groups
    monkeypatch.setattr(prefill_mod, "padding_groups", lambda *a: calls.append(real(*a)) or calls[-1])
    pv, tvs, s = check(models, [PROMPT_B, PROMPT_A], seed=11, warp=dict(temperature=0.9),
                       ssd_num_draft_tokens=2, ssd_fanout=[1, 1, 1], ssd_backup="ngram")
    assert pv > ALPHA, (pv, tvs, s)
    assert calls and all((c is not None) == grouped for c in calls)


# ---- negative controls: the same check must reject biased samplers --------------------------------------------------
def _accept_everything(drafts, n, p, q, generator=None):
    """Biased: verifies as if q were p (every draft accepted) - the output follows the draft, not the target."""
    return verify_sampled(drafts, n, p, p[:, : drafts.shape[1]].clone(), generator)


def _greedy_match_point_masses(drafts, n, p, q, generator=None):
    """The reference engine's bias: deterministic (n-gram) drafts accepted by greedy matching at T > 0."""
    out = verify_sampled(drafts, n, p, q, generator)
    point = (q.max(-1).values == 1).all(dim=1) & (n > 0)
    if point.any():
        B, K = drafts.shape
        ok = (drafts == p[:, :K].argmax(-1)) & (torch.arange(K)[None] < n[:, None])
        k = ok.long().cumprod(1).sum(1)
        bonus = sample(p[torch.arange(B), k], generator)
        out.accepted[point], out.bonus[point] = k[point], bonus[point]
    return out


def _forgot_downweight(self, scores, fanout=0):
    """Biased: drafts drawn from sigma_{F,C} but reported with q = plain softmax (C forgotten by the verifier)."""
    if self.greedy:
        return scores.argmax(dim=-1), None
    q_true = saguaro_probs(scores, fanout, self.downweight)
    return sample(q_true, self.generator), torch.softmax(scores.float(), -1)


@pytest.mark.parametrize(
    "bias,case",
    [("accept_everything", "sync"), ("greedy_ngram", "ngram"), ("forgot_downweight", "ssd_C03")],
)
def test_biased_samplers_are_rejected(models, monkeypatch, bias, case):
    if bias == "accept_everything":
        monkeypatch.setattr(engine_mod, "verify_sampled", _accept_everything)
    elif bias == "greedy_ngram":
        monkeypatch.setattr(engine_mod, "verify_sampled", _greedy_match_point_masses)
    else:
        monkeypatch.setattr(draft_mod.DraftModel, "propose", _forgot_downweight)
    c = CASES[case]
    pv, tvs, s = check(models, [PROMPT_A], seed=5, warp=c["warp"], **c["ssd"])
    assert pv < ALPHA, f"{bias}: the check failed to reject a biased sampler (p={pv:.3f}, tv={tvs})"


def test_check_detects_one_percent_bias(models):
    """Power of the check itself: moving 1% of probability between two mid-sized cells is rejected at N."""
    target, _ = models
    probs = exact_distribution(target, PROMPT_A, warpers())
    order = np.argsort(probs)
    a, b = order[len(order) // 2], order[-len(order) // 4]  # a median cell and an upper-quartile cell
    biased = probs.copy()
    shift = min(0.01, biased[a] * 0.9)
    biased[a] -= shift
    biased[b] += shift
    rng = np.random.default_rng(0)
    rejected = sum(p_value([(rng.multinomial(N, biased), probs)]) < ALPHA for _ in range(20))
    accepted_true = sum(p_value([(rng.multinomial(N, probs), probs)]) >= ALPHA for _ in range(20))
    assert rejected >= 16, rejected
    assert accepted_true >= 19, accepted_true


def rotating_controller_run(models, monkeypatch, plans: list, seed: int, in_loop: bool = False):
    """A controller that moves to the next of `plans` at every round (the first to start), on one sampled
    generate() call over every row: the p-value against the exact law, the stats and the plans decided. in_loop:
    a plain first plan runs in our loop (control.plain_loop), not handed off to transformers' loop."""
    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.control import drafter as drafter_mod

    seen = []

    def decide(self, current=None, horizon=None):
        plan = plans[0] if current is None else plans[(plans.index(current) + 1) % len(plans)]
        seen.append(plan)
        return ctl_mod.Decision(plan, "test: rotate", [], in_loop=in_loop)

    monkeypatch.setattr(ctl_mod.Controller, "decide", decide)
    monkeypatch.setattr(drafter_mod, "DECIDE_EVERY", 1)
    monkeypatch.setattr(drafter_mod, "DECIDE_SHARE", 1e9)  # every round decides, however long deciding took
    monkeypatch.setattr(drafter_mod, "CONFIRMATIONS", 1)
    monkeypatch.setattr(drafter_mod.ControlledDrafter, "_switch_could_pay", lambda self, verdict: True)  # to the end
    target, draft = models
    counts, s = run_ssd(target, draft, [PROMPT_A], seed=seed, warp=dict(temperature=0.9), ssd_budget=None)
    return p_value([(counts[0], exact_distribution(target, PROMPT_A, warpers(temperature=0.9)))]), s, seen


def test_distribution_exact_while_only_k_changes_every_round(models, monkeypatch):
    """Synchronous plans that differ only in K keep the draft's cache across a switch (SyncDrafter.retune): the
    next round drafts a different number of tokens from the same cache. The output law stays the target's."""
    from hf_ssd.control.plan import Plan

    pv, s, _ = rotating_controller_run(models, monkeypatch, [Plan("sync", 1), Plan("sync", 3), Plan("sync", 2)], 31)
    assert pv > ALPHA, (pv, s)
    assert [sw["to"] for sw in s["controller"]["switches"]][:1] == ["sync K=3"]


def test_distribution_exact_while_the_controller_switches_plans_every_round(models, monkeypatch):
    """ssd=True with no options: the controller may change plan between any two rounds (SSD, sync SD, plain steps,
    other K); each switch restarts the draft on the committed tokens. The output law stays the target's."""
    from hf_ssd.control.plan import Plan

    plans = [Plan("ssd", 1, 4, "inline"), Plan("sync", 2), Plan("plain"), Plan("ssd", 2, 4, "inline")]
    pv, s, seen = rotating_controller_run(models, monkeypatch, plans, 29)
    assert pv > ALPHA, (pv, s)
    assert len(s["controller"]["switches"]) >= 2 and {p.mode for p in seen} == {"ssd", "sync", "plain"}


def test_distribution_exact_when_a_call_decodes_plain_in_our_loop(models, monkeypatch):
    """A call whose controller starts plain decoding in our loop (its grouped prefill, then one-token rounds)
    instead of handing off to transformers' loop, then drafts: the output law stays the target's."""
    from hf_ssd.control.plan import Plan

    pv, s, seen = rotating_controller_run(models, monkeypatch, [Plan("plain"), Plan("sync", 2)], 37, in_loop=True)
    assert pv > ALPHA, (pv, s)
    assert s["rounds"] > 0 and s["controller"]["choice"] == "plain" and seen[0] == Plan("plain")
