"""The controller's plain hand-off: plain decoding on transformers' own loop, timed per decode step.

- With `ssd_compile_target=True` the loop runs on transformers' compiled fast path (a static cache plus a
  `compile_config`, also the bench's `plain:static-compile` baseline), so a plain choice runs as fast as plain
  decoding can here, not on the eager loop.
- `DecodeClock` times the decode steps alone: a call's wall time also holds the prompt's prefill, which would
  price plain decoding too high (most of all for short generations and long prompts).
"""
from __future__ import annotations

import statistics
import time

from transformers import Cache, LogitsProcessor, StaticCache


def static_compile_config(model):
    """The compile_config for generate() with cache_implementation="static", following transformers' CompileConfig
    docs: the decode step itself is compiled (the prefill stays eager). transformers does that automatically on
    CUDA (mode "reduce-overhead": CUDA graphs); on other devices only when the config's `_compile_all_devices` flag
    is set, which is how CompileConfig says to compile on e.g. CPU (mode "default" there: no CUDA graphs).
    dynamic=True as in CompileConfig's own example: one graph serves every prompt length and max_new_tokens."""
    from transformers import CompileConfig

    cuda = model.device.type == "cuda"
    cc = CompileConfig(fullgraph=False, dynamic=True, mode="reduce-overhead" if cuda else "default")
    if not cuda:
        cc._compile_all_devices = True
    return cc


def use_static_cache(model, generation_config, model_kwargs: dict) -> str | None:
    """Swap the dynamic cache generate() prepared for a static one of `max_length` slots and set the compile config,
    so transformers' decoding loop compiles its decode step. Returns None when done, else why it could not (the
    loop then runs eagerly, still exact)."""
    names = [k for k in ("cache", "past_key_values") if isinstance(model_kwargs.get(k), Cache)]
    if not names:
        return "no cache to replace"
    if model_kwargs[names[0]].get_seq_length() > 0:
        return "the cache given already holds tokens"
    try:
        cache = StaticCache(config=model.config.get_text_config(decoder=True),
                            max_cache_len=generation_config.max_length)
    except Exception as exc:  # noqa: BLE001 - an older or newer StaticCache signature: stay on the eager loop
        return f"{type(exc).__name__}: {exc}"
    model_kwargs[names[0]] = cache
    generation_config.compile_config = static_compile_config(model)
    return None


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (0 when torch._dynamo is unavailable): a call that
    raised it compiled, and its time is not the loop's."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return 0
    return int(counters["stats"]["unique_graphs"])


# A decode step more than this many times the median step is one that compiled (transformers' loop builds its graph
# on its first decode step, and again if a guard fails): left out of the step time, counted as compiling.
COMPILE_STEP = 5.0
MIN_STEPS = 8  # steps a call that compiled needs for its median to say what a step costs


class DecodeClock(LogitsProcessor):
    """A logits processor that changes nothing and notes when each step's logits came, the prefill's first: from
    then on every step is a decode step.

    `seconds_per_step(end, steps, compiled)`: decode seconds per new token after the first. Where the call compiled
    transformers' loop (`compiled`), the steps that built a graph are left out (COMPILE_STEP), and `compile_s` then
    holds what they took beyond a step: such a call used to go unrecorded, and plain kept an old price."""

    def __init__(self):
        self.stamps: list[float] = []
        self.compile_s = 0.0

    @property
    def first(self) -> float | None:
        return self.stamps[0] if self.stamps else None

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores

    def seconds_per_step(self, end: float, new_tokens: int, compiled: bool = False) -> float | None:
        if self.first is None or new_tokens < 2:
            return None
        if not compiled:
            return (end - self.first) / (new_tokens - 1)
        steps = [b - a for a, b in zip(self.stamps, [*self.stamps[1:new_tokens], end])][:new_tokens - 1]
        if len(steps) < MIN_STEPS:
            return None
        typical = statistics.median(steps)
        kept = [s for s in steps if s <= COMPILE_STEP * typical]
        step_s = sum(kept) / len(kept)
        self.compile_s = sum(s - step_s for s in steps if s > COMPILE_STEP * typical)
        return step_s
