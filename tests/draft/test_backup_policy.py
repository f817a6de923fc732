"""The backup policy decides a round's backup with that round's own measurements."""
from __future__ import annotations

import torch

from hf_ssd.config import SSDConfig
from hf_ssd.core.backup import BackupPolicy
from hf_ssd.core.types import Outcome, Verdict
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.saguaro import SaguaroDrafter
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.testing import get_pair, prompt


def test_backup_choice_sees_this_rounds_verify_time(monkeypatch):
    pair = get_pair("llama")
    config = SSDConfig(num_draft_tokens=3, backup="auto")
    drafter = SaguaroDrafter(DraftModel(pair.related, 1, 96, [], True, 1.0, None), config, SSDStats(), 6, True)
    seen = []
    original = BackupPolicy.choose

    def spy(policy, batch):
        seen.append(policy.t_verify.last)
        return original(policy, batch)

    monkeypatch.setattr(BackupPolicy, "choose", spy)
    ids = prompt(6, seed=3)
    spec = drafter.start(ids, torch.ones_like(ids))
    for verify_s in (0.125, 7.5, 0.25):
        drafter.begin(spec)
        # k = 0 with the rejected draft as bonus: never in the cache (fork excludes it), so the backup decides.
        outcome = Outcome(torch.tensor([0]), spec.tokens[:, 0].clone())
        verdict = Verdict(outcome, torch.tensor([True]), [ids[0]], [torch.ones(6, dtype=torch.bool)], verify_s)
        result = drafter.resolve(verdict)
        assert result.hits.tolist() == [False] and result.backup is not None
        assert seen[-1] == verify_s
        spec = result.spec
    assert seen == [0.125, 7.5, 0.25]


def test_fast_models_still_try_the_jit_backup():
    """Millisecond rounds (a GPU, a small compiled draft): the JIT backup, never run yet, is priced from the measured
    tree (not by a prior in seconds, which priced it at 100 verifies and so never tried it): a cheap draft's JIT is
    chosen at batch 1; once it has run, its own time decides, and one that costs many verifies gives way to the
    n-gram backup."""
    policy = BackupPolicy(SSDConfig(num_draft_tokens=4))
    for _ in range(30):
        policy.t_verify.add(0.008)
        policy.t_tree.add(0.004)  # 5 draft forwards of 0.8 ms
        policy.p_hit.add(0.8)
        policy.tokens["cache"].add(3.0)
    assert policy.choose(1) == "jit"
    for _ in range(30):
        policy.t_jit.add(0.2)  # 25 verifies: the stall costs more than the better proposals bring
    assert policy.choose(1) == "ngram"
