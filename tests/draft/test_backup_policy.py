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
