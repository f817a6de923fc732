"""Tree drafting: the batched tree forward gives, per branch, the logits of an ordinary forward along that branch."""
from __future__ import annotations

import pytest
import torch

from hf_ssd.runtime.kv import CachedModel
from hf_ssd.core.tree import Forks, fork, tree_attend
from hf_ssd.testing import ARCHS, get_pair, left_pad, prompt, tree_attend_reference

ATOL = 1e-4


@pytest.mark.parametrize("seed", range(6))
def test_tree_attend_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, L0, K = 3, int(torch.randint(0, 9, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
    N = int(torch.randint(1, 7, (1,), generator=g))
    past_valid = torch.rand(B, L0, generator=g) < 0.7
    n = torch.randint(0, K + 1, (B,), generator=g)
    glue_valid = torch.cat([torch.ones(B, 1, dtype=torch.bool), torch.arange(K)[None] < n[:, None]], 1)
    forks = Forks(
        torch.randint(0, 50, (B, N), generator=g),
        torch.minimum(torch.randint(0, K + 1, (B, N), generator=g), n[:, None]),
        torch.rand(B, N, generator=g) < 0.8,
    )
    for step in range(1, K + 1):
        assert torch.equal(tree_attend(past_valid, glue_valid, forks, step),
                           tree_attend_reference(past_valid, glue_valid, forks, step))


def test_fork_excludes_the_rejected_draft_and_respects_n():
    V = 10
    scores = torch.zeros(1, 3, V)
    scores[0, 0, [4, 5, 6]] = torch.tensor([3.0, 2.0, 1.0])  # top: 4, 5, 6
    scores[0, 1, [7, 8, 9]] = torch.tensor([3.0, 2.0, 1.0])
    scores[0, 2, [1, 2, 3]] = torch.tensor([3.0, 2.0, 1.0])
    drafts = torch.tensor([[4, 8]])
    f = fork(scores, drafts, torch.tensor([2]), torch.tensor([[2, 2, 1]]))
    got = [(int(d), int(t)) for d, t, v in zip(f.depth[0], f.tokens[0], f.valid[0]) if v]
    # position 0 excludes d_1 = 4, position 1 keeps 7 and 9 (d_2 = 8 excluded), position K excludes nothing
    assert got == [(0, 5), (0, 6), (1, 7), (1, 9), (2, 1)]
    f = fork(scores, drafts, torch.tensor([1]), torch.tensor([[1, 2, 5]]))  # n = 1: nothing past position 1
    got = [(int(d), int(t)) for d, t, v in zip(f.depth[0], f.tokens[0], f.valid[0]) if v]
    assert got == [(0, 5), (1, 7), (1, 8)]


@torch.no_grad()
def plain_last_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_tree_forward_equals_sequential_forward(arch):
    """Glue + forks + K tree steps on a left-padded batch (prompts longer than the sliding window): every branch's
    logits at every step equal a plain forward over prompt + accepted drafts + branch tokens."""
    model = get_pair(arch).target
    V = model.config.vocab_size
    K = 3
    rows = [prompt(10, seed=1)[0], prompt(6, seed=2)[0]]
    ids, mask = left_pad(rows)
    B = ids.shape[0]
    kv = CachedModel(model, B)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    kv.forward(ids[:, :-1], positions[:, :-1], mask[:, :-1].bool())
    t_prev = ids[:, -1]
    g = torch.Generator().manual_seed(0)
    drafts = torch.randint(2, V, (B, K), generator=g)
    n = torch.tensor([K, K - 1])  # row 1 has one draft slot fewer (a hole in the glue)
    start = kv.next_position()
    past_valid = kv.valid.clone()
    glue_start = kv.length
    glue_valid = torch.cat([torch.ones(B, 1, dtype=torch.bool), torch.arange(K)[None] < n[:, None]], 1)
    glue = kv.forward(torch.cat([t_prev[:, None], drafts], 1), start[:, None] + torch.arange(K + 1), glue_valid)
    # glue position j predicts the token after prompt + d_1..d_j
    for b in range(B):
        for j in range(int(n[b]) + 1):
            ref = plain_last_logits(model, rows[b].tolist() + drafts[b, :j].tolist())
            torch.testing.assert_close(glue[b, j], ref, atol=ATOL, rtol=ATOL)
    fanout = torch.tensor([[2, 1, 0, 2], [1, 2, 1, 3]])
    forks = fork(glue, drafts, n, fanout)
    assert int(forks.valid[0].sum()) == 5 and int(forks.valid[1].sum()) == 4  # row 1: position 3 is past n
    branch = [[[int(forks.tokens[b, i])] for i in range(forks.tokens.shape[1])] for b in range(B)]
    current = forks.tokens
    for step in range(1, K + 1):
        attend = tree_attend(past_valid, glue_valid, forks, step)
        logits = kv.forward(current, start[:, None] + forks.depth + step, forks.valid, attend)
        for b in range(B):
            for i in range(forks.tokens.shape[1]):
                if not forks.valid[b, i]:
                    continue
                j = int(forks.depth[b, i])
                seq = rows[b].tolist() + drafts[b, :j].tolist() + branch[b][i]
                torch.testing.assert_close(logits[b, i], plain_last_logits(model, seq), atol=ATOL, rtol=ATOL,
                                           msg=lambda m: f"row {b} branch {i} step {step}: {m}")
        current = torch.randint(2, V, current.shape, generator=g)
        for b in range(B):
            for i in range(current.shape[1]):
                branch[b][i].append(int(current[b, i]))
    # Outcome: row 0 accepted 1 draft, row 1 accepted 0. Drop the rest (glue tail + whole tree) and continue.
    k = torch.tensor([1, 0])
    kv.invalidate(glue_start + 1 + k)
    kv.trim()
    bonus = torch.tensor([5, 9])
    nxt = kv.forward(bonus[:, None], (start + k + 1)[:, None])
    for b in range(B):
        seq = rows[b].tolist() + drafts[b, : int(k[b])].tolist() + [int(bonus[b])]
        torch.testing.assert_close(nxt[b, 0], plain_last_logits(model, seq), atol=ATOL, rtol=ATOL)


def test_saguaro_cache_tokens_follow_their_branch():
    """SaguaroDrafter end to end on a greedy draft: each cached branch holds the draft's own greedy continuation
    of prompt + accepted drafts + the guessed bonus token."""
    from hf_ssd.config import SSDConfig
    from hf_ssd.draft.model import DraftModel, Speculation, SOURCE_JIT
    from hf_ssd.draft.saguaro import SaguaroDrafter
    from hf_ssd.runtime.stats import SSDStats
    from transformers import LogitsProcessorList

    model = get_pair("gemma3").target
    V = model.config.vocab_size
    K = 2
    rows = [prompt(9, seed=5)[0], prompt(5, seed=6)[0]]
    ids, mask = left_pad(rows)
    dm = DraftModel(model, 2, V, LogitsProcessorList(), True, 1.0, None)
    cfg = SSDConfig(num_draft_tokens=K, fanout=[1, 2, 1], budget=4, worker="inline")
    sd = SaguaroDrafter(dm, cfg, SSDStats(), 4, greedy=True)
    spec = sd.start(ids, mask)
    spec = Speculation(spec.tokens, spec.n, None, torch.full((2,), SOURCE_JIT))
    sd.begin(spec)
    c = sd.cache
    for b in range(2):
        for i in range(c.forks.tokens.shape[1]):
            if not c.forks.valid[b, i]:
                continue
            j = int(c.forks.depth[b, i])
            seq = rows[b].tolist() + spec.tokens[b, :j].tolist() + [int(c.forks.tokens[b, i])]
            for s in range(K):
                nxt = int(plain_last_logits(model, seq).argmax())
                assert int(c.tokens[b, i, s]) == nxt, (b, i, s)
                seq.append(nxt)
