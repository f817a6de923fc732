"""The static drafter carries the tree over (draft.static_saguaro, `REUSE_TREE`): after a hit, or a JIT backup, the
next round keeps the KV and scores the draft already computed for t*, d_1..d_{n-1} and skips the glue forward.

- what it keeps is what a glue forward computes: the same scores at every glue position, the same bonus guesses,
  the same drafts on the branches that do not wait for d_n (against the glue-every-round drafter, same outcomes);
- greedy output equals plain generate() on every tiny architecture, with left padding, rows finishing early, the JIT
  backup in the same batch as hits, compile off and on (no graph breaks, no recompilation);
- nothing on the hot path reads a tensor on the host;
- it only runs where it pays: never at α = 1 (a round after all drafts were accepted loses a draft).
The T > 0 law with it is checked by the chi-square suite (tests/exactness/test_sampling_exact.py, "reuse" cases).
"""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from hf_ssd.config import SSDConfig
from hf_ssd.core.types import Outcome, Verdict
from hf_ssd.draft import static_saguaro
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.static_saguaro import StaticSaguaroDrafter
from hf_ssd.runtime import static_kv
from hf_ssd.runtime.static_kv import StaticCachedModel
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.testing import ARCHS, VOCAB, get_pair, left_pad, plain_generate, prompt, ssd_generate

K, BUDGET = 3, 5


@pytest.fixture
def always_reuse(monkeypatch):
    """Carry the tree over whenever there is something to carry (the timing rule would decide otherwise)."""
    monkeypatch.setattr(StaticSaguaroDrafter, "_reuse_pays", lambda self: True)


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)


def _batch():
    return left_pad([prompt(11, seed=14)[0], prompt(5, seed=15)[0], prompt(1, seed=3)[0]])


def _drafter(model, B, reuse: bool, greedy=True, warpers=None, seed=0, fanout=None):
    config = SSDConfig(mode="ssd", num_draft_tokens=K, budget=BUDGET, backup="jit", worker="inline",
                       draft_quantize=None, fanout=fanout)
    gen = None if greedy else torch.Generator().manual_seed(seed)
    dm = DraftModel(model, B, VOCAB, warpers or LogitsProcessorList(), greedy, 1.0, gen,
                    StaticCachedModel(model, B, 256))
    d = StaticSaguaroDrafter(dm, config, SSDStats(), BUDGET, greedy)
    d.reuse = reuse
    return d


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_carried_over_tree_is_what_a_glue_forward_computes(arch, always_reuse):
    """Two drafters take the same outcomes: one carries the tree over, one runs the glue every round. On rounds where
    every row hit a branch that assumed fewer than all drafts accepted, or missed (JIT backup), both verify the same
    speculation: then the carried-over glue scores equal the glue forward's at every position, and so do the bonus
    guesses and the drafts of every branch that does not wait for d_n."""
    model = get_pair(arch).related
    ids, mask = _batch()
    glue, reuse = _drafter(model, 3, False), _drafter(model, 3, True)
    specs = [d.start(ids, mask) for d in (glue, reuse)]
    g = torch.Generator().manual_seed(5)
    compared = 0
    for rnd in range(8):
        for d, s in zip((glue, reuse), specs):
            d.begin(s)
        same_spec = torch.equal(specs[0].tokens, specs[1].tokens) and torch.equal(specs[0].n, specs[1].n)
        if same_spec:
            n = specs[1].n
            for j in range(K + 1):
                at = n >= j
                torch.testing.assert_close(reuse.glue_scores[at, j], glue.glue_scores[at, j], atol=1e-4, rtol=1e-4)
            assert torch.equal(reuse.cache.forks.tokens, glue.cache.forks.tokens)
            steady = reuse.cache.forks.valid & ~reuse.delayed
            assert torch.equal(reuse.cache.tokens[steady], glue.cache.tokens[steady])
            compared += 1
        # the same outcome for both: k < n (so the hit branch does not wait for d_n), a hit or a miss by turns
        f = glue.cache.forks
        n = specs[0].n
        k = torch.minimum(torch.randint(0, K, (3,), generator=g), n - 1)
        guess = torch.where(f.valid & (f.depth == k[:, None]), f.tokens, -1).max(dim=1).values
        miss = torch.randint(2, VOCAB - 1, (3,), generator=g)
        bonus = torch.where((torch.tensor([rnd % 2 == 0] * 3)) & (guess >= 0), guess, miss)
        verdict = Verdict(Outcome(k, bonus), torch.ones(3, dtype=torch.bool), [torch.arange(5)] * 3,
                          [torch.ones(5)] * 3, 0.01)
        specs = [d.resolve(verdict).spec for d in (glue, reuse)]
    assert compared >= 6 and reuse.stats.tree_reused >= 6 and glue.stats.tree_reused == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_with_the_tree_carried_over(arch, eager, always_reuse):
    p = get_pair(arch)
    ids, mask = _batch()
    free = plain_generate(p.target, ids[:1], attention_mask=mask[:1], max_new_tokens=24)
    eos = int(free[0, ids.shape[1] + 4])  # row 0 stops early
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos)
    for draft in (p.related, p.shallow):
        out = ssd_generate(p.target, draft, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos,
                           ssd_compile=True, ssd_num_draft_tokens=K, ssd_budget=BUDGET, ssd_worker="inline",
                           ssd_backup="jit", return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (out.sequences.tolist(), ref.tolist())
        s = out.ssd_stats
        assert s["draft_static"] and s["fallback_reason"] is None and s["tree_reused"] > 0, s


@pytest.mark.parametrize("K_", [2, 4])
def test_identity_other_shapes_and_workers(K_, eager, always_reuse):
    """K = 2 (delayed branches draft one token), fixed fan-outs heavy on the all-accepted branch, the thread
    worker, and the n-gram backup (a round after it runs the glue; the next all-hit round carries over again)."""
    p = get_pair("llama")
    ids, mask = _batch()
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=20)
    for worker, backup in (("thread", "jit"), ("inline", "auto"), ("inline", "ngram")):
        out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=20, ssd_compile=True,
                           ssd_num_draft_tokens=K_, ssd_budget=6, ssd_fanout=[1] * K_ + [3], ssd_worker=worker,
                           ssd_backup=backup, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (worker, backup)
        s = out.ssd_stats
        assert s["fallback_reason"] is None and s["tree_reused"] > 0, (worker, backup, s)
        # a round after an n-gram backup has nothing to carry over: it runs the glue
        assert s["tree_reused"] + s["backup_rounds"].get("ngram", 0) <= s["rounds"] - 1, (worker, backup, s)


def test_sampled_rows_carry_over_without_host_reads(eager, always_reuse, host_reads):
    """T > 0, a dead row: the carried-over round's tree (first step with d_n, delayed branches) reads nothing on the
    host; its q are distributions and a delayed branch's last slot is padding (n = K - 1)."""
    calls, state = host_reads
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(20)])
    d = _drafter(get_pair("qwen2").related, 3, True, greedy=False, warpers=warpers, seed=3, fanout=[2, 1, 0, 2])
    ids, mask = _batch()
    spec = d.start(ids, mask)
    rows, reused = 3, 0
    for rnd in range(5):
        carried = d.carried is not None
        state["on"] = True
        d.begin_no_sync(spec)
        f = d.cache.forks
        k = torch.zeros(rows, dtype=torch.long)
        outcome = Outcome(k, f.tokens[:, 0])
        d.cache.lookup(outcome)
        state["on"] = False
        assert calls == [], f"round {rnd}: host reads {calls}"
        reused += carried
        q = d.cache.q
        assert torch.allclose(q.sum(-1)[f.valid], torch.ones(()), atol=1e-5)
        if carried:
            assert torch.equal(d.cache.n, K - d.delayed.long()) and bool(d.delayed.any())
        else:
            assert d.cache.n is None and not bool(d.delayed.any())
        keep = torch.ones(rows, dtype=torch.bool)
        keep[0] = rnd != 1
        verdict = Verdict(outcome, keep, [torch.arange(5)] * int(keep.sum()), [torch.ones(5)] * int(keep.sum()), 0.0)
        spec = d.resolve(verdict).spec
        rows = int(keep.sum())
    assert reused >= 3


def test_compiled_with_the_tree_carried_over(always_reuse):
    """Compiled (CPU inductor): identical output, zero graph breaks, no recompilation from round to round."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    p = get_pair("llama")
    ids, mask = _batch()
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24)
    counters.clear()
    with inductor_config.patch(compile_threads=1):
        out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=24, ssd_compile=True,
                           ssd_num_draft_tokens=K, ssd_budget=BUDGET, ssd_worker="inline", ssd_backup="jit",
                           return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    s = out.ssd_stats
    assert s["draft_compiled"] and s["tree_reused"] > 0 and s["fallback_reason"] is None
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] <= 4  # widths 1, K + 1, N, N + 1


def test_reuse_pays_only_where_it_shortens_the_round(monkeypatch):
    d = _drafter(get_pair("llama").related, 1, True)
    d.backup.t_verify.add(1.0)
    d.t_forward.add(0.3)
    assert not d._reuse_pays()  # no acceptance observed yet: the α estimate is its prior
    for _ in range(8):
        d.planner.observe(True, 2, K)
    d.t_forward = type(d.t_forward)()
    d.t_forward.add(0.3)  # a tree of K + 1 = 4 forwards (1.2) is slower than the verify: one fewer saves 17%
    monkeypatch.setattr(d.planner, "alpha", (0.7, None))
    assert d._reuse_pays()
    monkeypatch.setattr(d.planner, "alpha", (1.0, None))  # every round accepts all: each would lose a draft
    assert not d._reuse_pays()
    d.t_forward.total, d.t_forward.count = 0.5, 1  # even where a forward is half the round (K + 1 = 4 of 2.0)
    assert not d._reuse_pays()
    monkeypatch.setattr(d.planner, "alpha", (0.9, None))  # there the loss (0.53 tokens of 3.44 per round) is covered
    assert d._reuse_pays()
    d.t_forward.total = 0.3
    d.t_forward.add(0.01)  # the tree hides behind the verify anyway: nothing to save
    d.t_forward.total = d.t_forward.last = 0.01
    d.t_forward.count = 1
    monkeypatch.setattr(d.planner, "alpha", (0.7, None))
    assert not d._reuse_pays()


def test_a_short_speculation_gets_the_all_accepted_fan_out():
    """A speculation of n < K drafts (a delayed branch's, an n-gram's) has no outcome past position n: position n
    (all accepted) takes the guesses of positions n..K. With F_n alone, a schedule that puts its budget on the
    all-accepted branch (α near 1) left that outcome without guesses (hit rate 100% -> 60%); with F_K alone, an
    n-gram speculation with no drafts (n = 0) got the after-miss schedule's F_K = 0 guesses."""
    d = _drafter(get_pair("llama").related, 3, True, fanout=[1, 1, 0, 3])
    fan = d._fanout(torch.tensor([0, 0, 0]), torch.tensor([K, K - 1, 0]))
    assert fan.tolist() == [[1, 1, 0, 3], [1, 1, 3, 3], [5, 1, 0, 3]]
