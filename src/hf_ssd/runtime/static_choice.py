"""When to use the static (compilable) caches of runtime/static_kv.py, and building them: the draft's for
`ssd_compile` (on CUDA; on CPU with "auto" only where a probe finds the compiled forward faster) and the target's
for `ssd_compile_target`. Each returns None where the dynamic cache serves better (compile off, a model split over
devices, absurd lengths, unsupported layouts)."""
from __future__ import annotations

import time
import warnings

import torch
from transformers import PreTrainedModel

from hf_ssd.core.tree import tree_width
from hf_ssd.runtime import static_kv
from hf_ssd.runtime.static_kv import StaticCachedModel, static_cache_len

MAX_SLOTS = 1 << 16  # beyond this many slots per row the static buffers are not worth it: the dynamic cache is used


def compilable(model: torch.nn.Module) -> bool:
    """Can torch.compile trace `model`'s forward? Not with torch.ao's dynamic int8 Linears (the int8 draft copy of
    draft/quant.py, or a draft its user quantized that way): they keep their packed weights in a TorchScript
    object, which dynamo refuses ("Failed to convert args/kwargs to proxy", torch 2.13). Tried anyway, every width
    failed to compile in every call, warned, and ran eagerly."""
    return not any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules())


def _probe_faster(kv: StaticCachedModel, width: int, reps: int = 5) -> bool:
    """One fixed-shape forward of `width` tokens per row, eager vs compiled (compile time excluded): is compiled
    faster? The result is kept on the registry entry (so once per process and shapes)."""
    e = kv.entry
    if width in e.probe:
        return e.probe[width]
    B = kv.batch
    tokens = torch.zeros(B, width, dtype=torch.long, device=kv.device)
    positions = torch.arange(width, device=kv.device)[None].expand(B, width)

    def timed(compiled: bool) -> float:
        kv.compile = compiled
        best = float("inf")
        for _ in range(reps):
            e.reset()
            kv._bound = 0
            if kv.device.type == "cuda":
                torch.cuda.synchronize(kv.device)
            t0 = time.perf_counter()
            kv.forward(tokens, positions)
            if kv.device.type == "cuda":
                torch.cuda.synchronize(kv.device)
            best = min(best, time.perf_counter() - t0)
        return best

    kv.forward(tokens[:, :1], positions[:, :1])  # allocate the buffers (eager)
    eager = timed(False)
    compiled = timed(True)  # the first rep compiles (counted in compile_s)
    compiled = timed(True)
    e.probe[width] = width in e.compiled_widths and compiled < 0.9 * eager
    e.reset()
    kv._bound, kv.forwards, kv.compiled_calls = 0, 0, 0
    return e.probe[width]


def sync_sequence_len(max_length: int, prompt_len: int = 0) -> int:
    """The longest a synchronous draft's row gets, holes included: it leaves a hole each round whose last draft is
    rejected (its two pending tokens always take two slots), at most one per new token, so the call's length plus
    its new tokens again. Counting the prompt twice (2 x max_length) made its cache, and the slots every draft step
    attends over, up to twice as large for long prompts (a 450-token prompt and 64 new tokens: 2048 slots, where
    596 can ever be used; now 1024)."""
    return 2 * int(max_length) - min(max(int(prompt_len), 0), int(max_length))


def static_draft_cache(model: PreTrainedModel, config, batch: int, max_length: int, K: int, budget: int,
                       vocab_size: int, sync: bool = False, progress: bool = False,
                       prompt_len: int = 0, warn_int8: bool = True) -> StaticCachedModel | None:
    """The draft cache `config.compile` asks for: a StaticCachedModel (compiled or not), or None for the dynamic
    `CachedModel` (compile off, offloaded models, absurd lengths, unsupported models). With the process worker the
    child builds it, on its own copy of the model (workers.process).

    Compiled widths: SSD's glue (K + 1), tree step (N branches), first tree step with the last draft when the
    tree is carried over (N + 1, draft.static_saguaro) and the single steps of its just-in-time backup
    after a miss (1: eager, its K serial steps cost so much that the backup policy picks the weaker n-gram);
    synchronous SD's single draft steps (1) and the two pending tokens each round starts with (2). All of them compile
    here, before the prompt, so no round builds a graph (progress: a bar while they do). prompt_len: the call's
    prompt (padded), which sizes a synchronous draft's room for holes (`sync_sequence_len`)."""
    mode = getattr(config, "compile", False)
    if mode is False:
        return None
    if not compilable(model):
        if mode is True and warn_int8:  # not where the controller chose the int8 copy: it charges it no compile
            warnings.warn("hf_ssd: ssd_compile: the int8 draft runs eagerly (torch.compile cannot trace torch.ao's "
                          "dynamic int8 Linears); pass ssd_draft_quantize=None to compile the draft.", RuntimeWarning,
                          stacklevel=2)
        return None
    device_map = getattr(model, "hf_device_map", None)
    if device_map is not None and len(set(device_map.values())) > 1:
        return None
    N = 1 if sync else tree_width(config, K, budget, vocab_size)
    M = static_cache_len(sync_sequence_len(max_length, prompt_len) if sync else max_length, K, 0 if sync else N)
    if M > MAX_SLOTS:
        return None
    try:
        # N + 1: the first tree step of a round that carries the tree over (K >= 2, see draft.static_saguaro)
        widths = (1, 2) if sync else (1, K + 1, N) + ((N + 1,) if K >= 2 else ())
        kv = StaticCachedModel(model, batch, M, compile=True, hot_widths=widths, guard_modules=False)
    except (ValueError, TypeError, AttributeError) as exc:  # layouts CachedModel would also refuse, odd configs
        warnings.warn(f"hf_ssd: ssd_compile: the static draft cache does not support this model ({exc}); using the "
                      "dynamic cache.", RuntimeWarning, stacklevel=2)
        return None
    if mode == "auto" and kv.device.type != "cuda" and not (kv.device.type == "cpu" and _probe_faster(kv, N)):
        kv.release()  # eager static buffers buy nothing over the dynamic cache
        return None
    kv.compile = True
    kv.precompile(progress=progress)
    return kv


TARGET_K_MAX = 16  # the target's static cache has room for a round of this many drafts
# verify blocks of K + 1 tokens, and plain decoding's one-token steps in our loop: each compiles at its first use
VERIFY_WIDTHS = tuple(range(1, TARGET_K_MAX + 2))


def static_target_cache(model: PreTrainedModel, batch: int, max_length: int, K_max: int = TARGET_K_MAX
                        ) -> StaticCachedModel | None:
    """`ssd_compile_target`: the target's cache as static buffers whose verify block (K + 1 tokens wide) runs
    compiled; None (the dynamic cache) for a model split over devices or an absurd length. The target's logits are
    then its compiled graph's (as with transformers' own static-cache compile path): the same model, float rounding
    of the compiled kernels."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map is not None and len(set(device_map.values())) > 1:
        return None
    M = static_cache_len(max_length, K_max, 0)
    if M > MAX_SLOTS:
        return None
    if not compilable(model):
        warnings.warn("hf_ssd: ssd_compile_target: this target's torch.ao int8 Linears cannot be compiled; the target "
                      "verifies eagerly.", RuntimeWarning, stacklevel=2)
        return None
    try:
        return StaticCachedModel(model, batch, M, compile=static_kv.COMPILE_ENABLED, hot_widths=VERIFY_WIDTHS)
    except (ValueError, TypeError, AttributeError) as exc:
        warnings.warn(f"hf_ssd: ssd_compile_target: the static cache does not support this model ({exc}); the "
                      "target verifies eagerly.", RuntimeWarning, stacklevel=2)
        return None
