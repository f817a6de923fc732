"""scripts/context_cost.py: its random cache has the context asked for, its padded mask hides what it says, and a
forward over them runs (on a tiny model)."""
import runpy
from pathlib import Path

import torch

from hf_ssd.testing import tiny_pair

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "context_cost.py"


def test_random_cache_mask_and_a_timed_forward():
    script = runpy.run_path(str(SCRIPT))
    target, _, _ = tiny_pair()
    cache = script["random_cache"](target, batch=2, context=40)
    assert cache.get_seq_length() == 40
    mask = script["padded_mask"](2, 3, 40)
    assert mask.shape == (2, 1, 3, 43)
    blocked = mask == torch.finfo(torch.float32).min
    assert blocked[0, 0, :, :20].all() and not blocked[1, 0, :, :40].any()  # row 0's first half is padding
    assert blocked[:, 0, 0, 41:].all() and not blocked[:, 0, 2, 40:].any()  # causal over the new tokens
    for padded in (False, True):
        assert script["forward_ms"](target, 2, 40, 3, 1, 1, padded) > 0
