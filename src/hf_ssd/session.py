"""The composition root of one ssd=True generation: the target cache, the draft side (a fallback chain of exact
drafters on the worker the config asks for) and the engine that runs them."""
from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from hf_ssd.config import SSDConfig
from hf_ssd.draft.fallback import FallbackDrafter
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.protocol import Drafter
from hf_ssd.draft.quant import quantized_draft
from hf_ssd.draft.sync import NullDrafter, SyncDrafter
from hf_ssd.runtime.budget import measure_budget
from hf_ssd.runtime.engine import Engine, RowOutputs
from hf_ssd.runtime.kv import CachedModel, input_device
from hf_ssd.runtime.processing import check_processors, with_temperature
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.workers import make_drafter


def draft_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """The draft side's own RNG, seeded from the caller's, so sampling stays reproducible when it runs in a thread."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    return torch.Generator(device=device).manual_seed(seed)


def run_session(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    processors: LogitsProcessorList,
    stopping: StoppingCriteriaList,
    generation_config: GenerationConfig,
    config: SSDConfig,
    generator: torch.Generator | None,
    streamer=None,
    worker=None,
) -> tuple[RowOutputs, SSDStats]:
    check_processors(processors)
    if config.draft_device is not None:
        draft.to(config.draft_device)
    draft = quantized_draft(draft, config.draft_quantize)
    B = input_ids.shape[0]
    greedy = not generation_config.do_sample
    vocab = target.config.get_text_config().vocab_size
    draft_processors = with_temperature(processors, config.draft_temperature)
    stats = SSDStats(mode=config.mode)
    d_device = input_device(draft)
    d_gen = None if greedy else draft_generator(generator, d_device)

    def make_draft_model(batch: int, downweight: float) -> DraftModel:
        return DraftModel(draft, batch, vocab, draft_processors, greedy, downweight, d_gen)

    K = config.num_draft_tokens

    def ssd_drafter() -> Drafter:
        # The budget probe runs the draft model, so it sits inside the chain: a broken draft falls back from here too.
        budget = config.budget or measure_budget(target, draft, K, B)
        return make_drafter(config, make_draft_model(B, config.downweight), stats, budget, greedy, worker)

    def sync_drafter() -> Drafter:
        stats.worker = "inline"
        return SyncDrafter(make_draft_model(B if config.mode == "sync" else 0, 1.0), K, stats)

    # The fallback chain: each is exact; a failure moves to the next (plain target steps never fail on the draft).
    chain = [ssd_drafter] if config.mode == "ssd" else []
    chain += [sync_drafter, lambda: NullDrafter(K, input_device(target))]
    drafter = FallbackDrafter(chain, stats)
    target_kv = CachedModel(target, B)
    engine = Engine(target_kv, drafter, processors, stopping, generation_config, stats, generator, streamer)
    start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if config.target_threads is not None:
        torch.set_num_threads(config.target_threads)
    try:
        rows = engine.run(input_ids.to(target_kv.device), mask.to(target_kv.device))
    finally:
        drafter.close()
        torch.set_num_threads(threads_before)
    stats.wall_time = time.perf_counter() - start
    stats.draft_forwards = drafter.forwards
    return rows, stats
