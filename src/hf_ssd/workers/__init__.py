"""Where the draft side runs. Each worker is a `Drafter` (see hf_ssd.draft.protocol) around a SaguaroDrafter:

- inline: the SaguaroDrafter itself; the tree is built in `begin`, before the verify (the exact reference);
- thread: a background thread (its own CUDA stream on GPU) builds it while the caller's thread verifies;
- process: a spawned process with its own threads (or GPU) builds it; see `DraftProcess` to keep one alive.

The concurrent workers' `resolve` waits for the build, so every worker gives results identical to inline.
"""
from __future__ import annotations

import os

import torch

from hf_ssd.config import SSDConfig
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.protocol import Drafter
from hf_ssd.runtime.stats import SSDStats


def default_worker(device: torch.device) -> str:
    """Thread on CPU with two or more cores and on GPU (own stream); inline on a single core."""
    if device.type == "cuda":
        return "thread"
    return "thread" if (os.cpu_count() or 1) >= 2 else "inline"


def make_drafter(config: SSDConfig, draft: DraftModel, stats: SSDStats, budget: int, greedy: bool,
                 process=None, max_length: int | None = None) -> Drafter:
    """The Saguaro drafter on the worker the config asks for (`process`: a kept DraftProcess, if any; `max_length`:
    the generation's, which sizes a process worker's static cache when `config.compile` asks for one)."""
    from hf_ssd.draft.saguaro import SaguaroDrafter
    from hf_ssd.draft.static_saguaro import StaticSaguaroDrafter

    kind = config.worker if config.worker != "auto" else default_worker(draft.kv.device)
    stats.worker = kind
    if kind == "process":
        from hf_ssd.workers.process_drafter import ProcessDrafter

        return ProcessDrafter(draft, config, stats, budget, greedy, process, max_length)
    # a static (compilable) draft cache (runtime.static_kv) gets the sync-free, fixed-shape tree
    drafter_class = StaticSaguaroDrafter if getattr(draft.kv, "static", False) else SaguaroDrafter
    inner = drafter_class(draft, config, stats, budget, greedy)
    if kind == "thread":
        from hf_ssd.workers.thread import ThreadDrafter

        return ThreadDrafter(inner, config.draft_threads)
    return inner
