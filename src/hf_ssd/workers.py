"""Where the draft side runs: inline (the exact reference) for now."""
from __future__ import annotations

from .config import SSDConfig
from .draft import DraftModel
from .stats import SSDStats


def make_drafter(config: SSDConfig, draft: DraftModel, stats: SSDStats, budget: int, greedy: bool):
    from .saguaro import SaguaroDrafter

    stats.worker = "inline"
    return SaguaroDrafter(draft, config, stats, budget, greedy)
