"""Greedy (T = 0) SSD must return exactly what plain generate() returns, token for token (float32)."""
from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_ssd.testing import ARCHS, PAD, VOCAB, get_pair, left_pad, plain_generate, prompt, ssd_generate

MODES = ["sync", "ssd"]


def alone_tokens(model, row: torch.Tensor, new: int, **kw) -> list[int]:
    """Plain generate of one unpadded row; padded with PAD up to `new` tokens if it stopped early (EOS)."""
    gen = plain_generate(model, row[None], max_new_tokens=new, **kw)[0, row.numel():].tolist()
    return gen + [PAD] * (new - len(gen))


def assert_same(out, ref):
    out = out.sequences if hasattr(out, "sequences") else out
    assert out.shape == ref.shape, (out.tolist(), ref.tolist())
    assert torch.equal(out, ref), f"\nssd:   {out.tolist()}\nplain: {ref.tolist()}"


# ---- every architecture x mode x K x prompt length --------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 3, 5])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_identity_arch_mode_k(arch, mode, K):
    p = get_pair(arch)
    short = {1: 1, 3: 4, 5: 2}[K]
    for length, seed in ((short, 10 + K), (13, 20 + K)):  # 13 > sliding window 4 (gemma3, mistral)
        ids = prompt(length, seed=seed)
        ref = plain_generate(p.target, ids, max_new_tokens=16)
        out = ssd_generate(p.target, p.related, ids, max_new_tokens=16, ssd_mode=mode, ssd_num_draft_tokens=K,
                           return_dict_in_generate=True)
        assert_same(out, ref)
        assert out.ssd_stats["drafted"] > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_identity_shallow_draft(arch, mode):
    """A draft with fewer layers (Gemma3: only a sliding-window layer) on a left-padded batch."""
    p = get_pair(arch)
    ids, mask = left_pad([prompt(11, seed=14)[0], prompt(5, seed=15)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=14)
    out = ssd_generate(p.target, p.shallow, ids, attention_mask=mask, max_new_tokens=14, ssd_mode=mode,
                       ssd_num_draft_tokens=2, return_dict_in_generate=True)
    assert_same(out, ref)


def test_related_draft_acceptance_is_nontrivial():
    """The `related` drafts must be neither useless nor identical, else the identity tests prove little."""
    means = []
    for arch in ("llama", "gemma3", "gpt2", "neox"):
        p = get_pair(arch)
        out = ssd_generate(p.target, p.related, prompt(8, seed=4), max_new_tokens=20, ssd_mode="sync",
                           ssd_num_draft_tokens=3, return_dict_in_generate=True)
        means.append(out.ssd_stats["mean_accepted"])
    assert 0.2 < sum(means) / len(means) < 2.9, means


# ---- batches with mixed prompt lengths ----------------------------------------------------------------------------
def _batch(n: int, seed: int):
    lengths = [(3 + 5 * i + seed) % 12 + 1 for i in range(n)]
    return [prompt(L, seed=100 * seed + i)[0] for i, L in enumerate(lengths)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_identity_batch_mixed_lengths(arch, mode):
    p = get_pair(arch)
    rows = _batch(5, seed=1)
    ids, mask = left_pad(rows)
    new = 12
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=new, ssd_mode=mode,
                       ssd_num_draft_tokens=3)
    # each row equals the row generated alone by plain generate
    for i, r in enumerate(rows):
        alone = alone_tokens(p.target, r, new)
        assert out[i, ids.shape[1]:].tolist() == alone[: out.shape[1] - ids.shape[1]], f"row {i} (len {r.numel()})"
    # and the batch equals plain batched generate
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=new)
    assert_same(out, ref)


@pytest.mark.parametrize("B", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", MODES)
def test_identity_batch_sizes(mode, B):
    p = get_pair("qwen3")
    rows = _batch(B, seed=B)
    ids, mask = left_pad(rows)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=14, ssd_mode=mode,
                       ssd_num_draft_tokens=4)
    for i, r in enumerate(rows):
        alone = alone_tokens(p.target, r, 14)
        assert out[i, ids.shape[1]:].tolist() == alone[: out.shape[1] - ids.shape[1]], f"row {i}"


# ---- fan-out, budget, backups, hit-only / miss-only -----------------------------------------------------------------
@pytest.mark.parametrize(
    "K,fanout,budget",
    [
        (3, [2, 0, 0, 1], 3),
        (3, [0, 0, 0, 1], 1),
        (3, [1, 1, 1, 1], 4),
        (3, [0, 3, 0, 0], 3),
        (2, [4, 4, 4], 12),
        (3, None, 1),  # budget 1: geometric schedule with a single branch
        (3, None, 40),  # large budget
        (5, None, 8),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_identity_fanouts(arch, K, fanout, budget):
    p = get_pair(arch)
    rows = _batch(3, seed=7)
    ids, mask = left_pad(rows)
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=18)
    kw = {} if fanout is None else {"ssd_fanout": fanout}
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=18, ssd_num_draft_tokens=K,
                       ssd_budget=budget, return_dict_in_generate=True, **kw)
    assert_same(out, ref)
    if fanout is not None:
        assert out.ssd_stats["fanout_after_hit"] == fanout


@pytest.mark.parametrize("backup", ["jit", "ngram"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "neox"])
def test_identity_forced_backup(arch, backup):
    p = get_pair(arch)
    # a repetitive prompt, so the n-gram backup finds matches
    base = prompt(5, seed=21)[0]
    rows = [base.repeat(3), prompt(4, seed=22)[0], base.repeat(2)]
    ids, mask = left_pad(rows)
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=20)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=20, ssd_num_draft_tokens=3,
                       ssd_backup=backup, ssd_fanout=[1, 0, 0, 1], return_dict_in_generate=True)
    assert_same(out, ref)
    stats = out.ssd_stats
    assert set(stats["backup_rounds"]) <= {backup}
    assert stats["backup_rounds"].get(backup, 0) > 0, stats


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_hit_only(arch):
    """Draft == target with a fan-out that guesses every k: every lookup hits and every draft is accepted."""
    p = get_pair(arch)
    ids, mask = left_pad([prompt(7, seed=31)[0], prompt(3, seed=32)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=17)
    K = 3
    out = ssd_generate(p.target, p.same, ids, attention_mask=mask, max_new_tokens=17, ssd_num_draft_tokens=K,
                       ssd_fanout=[1] * (K + 1), ssd_budget=K + 1, return_dict_in_generate=True)
    assert_same(out, ref)
    s = out.ssd_stats
    assert s["cache_lookups"] > 0 and s["hit_rate"] == 1.0, s
    assert s["mean_accepted"] == K
    assert s["backup_rounds"] == {}


@pytest.mark.parametrize("backup", ["jit", "ngram"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_miss_only(arch, backup):
    """Zero fan-out: the cache is empty, every lookup misses and the backup serves every round."""
    p = get_pair(arch)
    ids, mask = left_pad([prompt(9, seed=41)[0], prompt(2, seed=42)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=15)
    K = 3
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=15, ssd_num_draft_tokens=K,
                       ssd_fanout=[0] * (K + 1), ssd_budget=1, ssd_backup=backup, return_dict_in_generate=True)
    assert_same(out, ref)
    s = out.ssd_stats
    assert s["cache_lookups"] > 0 and s["cache_hits"] == 0, s
    assert s["backup_rounds"][backup] == s["rounds"] - 1


# ---- logits processors ---------------------------------------------------------------------------------------------
PROCESSORS = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "no_repeat_ngram": dict(no_repeat_ngram_size=1),
    "min_new_tokens": dict(min_new_tokens=10),
    "bad_words": dict(bad_words_ids="from_output"),
    "no_repeat_bigram": dict(no_repeat_ngram_size=2),
    "all": dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=4, bad_words_ids="from_output"),
}


def processor_kwargs(name: str, free: torch.Tensor, P: int) -> dict:
    """PROCESSORS[name], with bad words taken from the unconstrained output `free` (so they bite): one
    single-token bad word and one two-token bad word."""
    kw = dict(PROCESSORS[name])
    if kw.get("bad_words_ids") == "from_output":
        kw["bad_words_ids"] = [[int(free[0, P + 2])], [int(free[1, P + 3]), int(free[1, P + 4])]]
    return kw


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(PROCESSORS))
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_identity_with_processors(arch, name, mode):
    p = get_pair(arch)
    rows = [prompt(6, seed=51)[0], prompt(10, seed=52)[0], prompt(3, seed=53)[0]]
    ids, mask = left_pad(rows)
    free = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=12)
    kw = processor_kwargs(name, free, ids.shape[1])
    if name in ("min_new_tokens", "all"):
        # make min_new_tokens bite: an EOS the model emits early without the processor
        eos = int(free[0, ids.shape[1] + 1])
        kw["eos_token_id"] = eos
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=20, **kw)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=20, ssd_mode=mode,
                       ssd_num_draft_tokens=3, **kw)
    assert_same(out, ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_processors_change_the_output(arch):
    """Guard: the processor settings above change greedy outputs (else the test above is vacuous)."""
    p = get_pair(arch)
    ids, mask = left_pad([prompt(6, seed=51)[0], prompt(10, seed=52)[0], prompt(3, seed=53)[0]])
    base = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=20)
    for name in ("repetition_penalty", "no_repeat_ngram", "bad_words"):
        kw = processor_kwargs(name, base, ids.shape[1])
        out = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=20, **kw)
        assert not torch.equal(out, base), name


@pytest.mark.parametrize("mode", MODES)
def test_prefix_allowed_tokens_fn_sees_original_batch_index(mode):
    """prefix_allowed_tokens_fn(batch_id, ids): batch_id must be the row's index in the caller's batch, also when
    rows are verified in groups of equal length or after other rows finished."""
    p = get_pair("llama")
    ids, mask = left_pad([prompt(4, seed=54)[0], prompt(9, seed=55)[0], prompt(6, seed=56)[0]])

    def allowed(batch_id, sent):
        # row b may only use tokens congruent to b mod 3 (plus EOS); depends on the batch index only
        return [t for t in range(VOCAB) if t % 3 == batch_id % 3]

    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=12, prefix_allowed_tokens_fn=allowed)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=12, ssd_mode=mode,
                       ssd_num_draft_tokens=3, prefix_allowed_tokens_fn=allowed)
    assert_same(out, ref)


# ---- stopping: EOS inside an accepted block, max_length, custom criteria --------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_eos_inside_accepted_block(arch, mode):
    p = get_pair(arch)
    rows = [prompt(5, seed=61)[0], prompt(9, seed=62)[0], prompt(2, seed=63)[0]]
    ids, mask = left_pad(rows)
    P = ids.shape[1]
    free = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24)
    # EOS = the 6th generated token of row 0: with the same draft, it lands inside an accepted block
    eos = int(free[0, P + 5])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos)
    for draft in (p.same, p.related):
        out = ssd_generate(p.target, draft, ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos,
                           ssd_mode=mode, ssd_num_draft_tokens=4, return_dict_in_generate=True)
        assert_same(out, ref)
        seq = out.sequences[0, P:].tolist()
        first = seq.index(eos)
        assert first <= 5 and all(t == PAD for t in seq[first + 1:])
    # with draft == target the EOS was accepted inside a block (more tokens were accepted than emitted)
    out = ssd_generate(p.target, p.same, ids[:1], attention_mask=mask[:1], max_new_tokens=24, eos_token_id=eos,
                       ssd_mode=mode, ssd_num_draft_tokens=4, return_dict_in_generate=True)
    gen = out.sequences[0, P:].tolist()
    assert gen[-1] == eos and len(gen) <= 6


@pytest.mark.parametrize("mode", MODES)
def test_max_length(mode):
    p = get_pair("qwen2")
    ids, mask = left_pad([prompt(4, seed=71)[0], prompt(8, seed=72)[0]])
    for max_length in (ids.shape[1] + 1, ids.shape[1] + 7):
        ref = plain_generate(p.target, ids, attention_mask=mask, max_length=max_length)
        out = ssd_generate(p.target, p.same, ids, attention_mask=mask, max_length=max_length, ssd_mode=mode,
                           ssd_num_draft_tokens=5)
        assert_same(out, ref)
        assert out.shape[1] == max_length


class StopOnToken(StoppingCriteria):
    """Per-row stop once `token` was generated (checks only the last position)."""

    def __init__(self, token: int):
        self.token = token
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return input_ids[:, -1] == self.token


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("mode", MODES)
def test_custom_stopping_criteria(mode):
    p = get_pair("llama")
    ids, mask = left_pad([prompt(6, seed=81)[0], prompt(3, seed=82)[0], prompt(11, seed=83)[0]])
    P = ids.shape[1]
    free = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=20)
    stop_tok = int(free[1, P + 4])
    for crit in (StopOnToken(stop_tok), StopAtLength(P + 9)):
        ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=20,
                             stopping_criteria=StoppingCriteriaList([crit]))
        out = ssd_generate(p.target, p.same, ids, attention_mask=mask, max_new_tokens=20, ssd_mode=mode,
                           ssd_num_draft_tokens=4, stopping_criteria=StoppingCriteriaList([crit]))
        assert_same(out, ref)
    assert ref.shape[1] == P + 9


def test_eos_list_and_vocab_guard():
    """A list of EOS ids, one of which appears mid-block."""
    p = get_pair("neox")
    ids = prompt(7, seed=91)
    free = plain_generate(p.target, ids, max_new_tokens=20)
    eos = [int(free[0, 7 + 3]), VOCAB - 2]
    ref = plain_generate(p.target, ids, max_new_tokens=20, eos_token_id=eos)
    out = ssd_generate(p.target, p.same, ids, max_new_tokens=20, eos_token_id=eos, ssd_num_draft_tokens=5)
    assert_same(out, ref)
