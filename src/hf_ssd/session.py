"""One ssd=True generation: build the target cache, the draft side chosen by the config, and run the engine."""
from __future__ import annotations

import time
import warnings

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from .config import SSDConfig
from .draft import DraftModel
from .draft_quant import quantized_draft
from .engine import Engine, RowOutputs
from .kv import CachedModel, input_device
from .processing import check_processors, with_temperature
from .stats import SSDStats
from .sync_drafter import NullDrafter, SyncDrafter


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

    made_by_fallback: list = []

    def fallback(failed):
        # First failure: the exact synchronous drafter on fresh caches. If a drafter made here fails too, the draft
        # model itself is the problem: no drafts at all.
        if isinstance(failed, NullDrafter) or any(failed is d for d in made_by_fallback):
            return NullDrafter(config.num_draft_tokens, input_device(target))
        made_by_fallback.append(SyncDrafter(make_draft_model(0, 1.0), config.num_draft_tokens, stats))
        return made_by_fallback[-1]

    if config.mode == "sync":
        drafter = SyncDrafter(make_draft_model(B, 1.0), config.num_draft_tokens, stats)
        stats.worker = "inline"
    else:
        from .budget import measure_budget
        from .workers import make_drafter

        budget = config.budget or measure_budget(target, draft, config.num_draft_tokens, B)
        try:
            drafter = make_drafter(config, make_draft_model(B, config.downweight), stats, budget, greedy, worker)
        except Exception as exc:  # e.g. a kept draft process that died: same exact fallback as mid-generation
            warnings.warn(f"hf_ssd: could not start the SSD draft side ({type(exc).__name__}: {exc}); using the "
                          "exact synchronous path.", RuntimeWarning, stacklevel=4)
            stats.fallback_reason = f"{type(exc).__name__}: {exc}"
            drafter = fallback(None)
    target_kv = CachedModel(target, B)
    engine = Engine(target_kv, drafter, processors, stopping, generation_config, stats, generator, streamer, fallback)
    start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if config.target_threads is not None:
        torch.set_num_threads(config.target_threads)
    try:
        rows = engine.run(input_ids.to(target_kv.device), mask.to(target_kv.device))
    finally:
        engine.drafter.close()
        torch.set_num_threads(threads_before)
    stats.wall_time = time.perf_counter() - start
    stats.draft_forwards = draft_forward_count(engine.drafter, drafter)
    return rows, stats


def draft_forward_count(*drafters) -> int:
    seen, total = set(), 0
    for d in drafters:
        total += getattr(d, "remote_forwards", 0)
        model = getattr(d, "draft", None)
        if model is not None and id(model) not in seen:
            seen.add(id(model))
            total += model.kv.forwards
    return total
