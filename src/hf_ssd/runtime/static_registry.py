"""The static caches' registry: buffers and compiled graphs, once per (model, batch, M, dtype, device) per process.

A second generate() with the same shapes reuses both (no re-allocation, no recompilation); a larger free entry, up
to REUSE_LARGER times the slots asked for, serves before a new one is built; entries die with their model (weak
reference) and `clear()` drops the free ones. Compiling happens per width of forward (`Entry.compiled_step`), and a
width whose compile fails runs eagerly (`Entry.may_compile`).
"""
from __future__ import annotations

import threading
import types
import weakref

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from hf_ssd.runtime.kv import input_device
from hf_ssd.runtime.slot_step import SPARE_SLOTS, Pointer, SlotLayer, slot_step

# seconds spent compiling and graphs built, all entries of this process together: what a new graph costs here
COMPILE_SPENT = {"seconds": 0.0, "graphs": 0}
COMPILE_TRIES = 2  # a width whose compile failed this many times runs eagerly for the life of the process


def _fresh_function(fn):
    """A copy of `fn` with its own code object: dynamo keeps compiled graphs (and counts recompilations) per code
    object, so each cache entry (and width) gets its own graphs and its own recompile limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_mode(device: torch.device) -> str | None:
    """CUDA graphs on GPU; inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def compile_kwargs(device: torch.device, guard_modules: bool = True) -> dict:
    """torch.compile's arguments for one width of the slot step: fixed shapes, one graph, CUDA graphs on GPU.

    guard_modules=False drops dynamo's guards on the model's modules where this torch can (the draft's: measured on
    the project's 2-core CPU, 8-layer overhead-workload draft, 3 tokens per row, 0.77 -> 0.71 ms a forward). Each
    entry compiles its own copy of the function for one model object (`_fresh_function`), so only editing that
    model's modules in place mid-process could change what a module guard checks; the inputs' shapes, strides and
    dtypes and the globals are still checked on every call. The draft may do so safely: whatever function its
    graph computes, the tokens and q come from that same graph, and the verifier's correction keeps the target's
    law. The target's verify keeps every guard: its logits are the output's law."""
    kw: dict = {"fullgraph": True, "dynamic": False}
    mode = compile_mode(device)
    skip = None if guard_modules else getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    options = cpu_wrapper_options() if device.type == "cpu" else {}
    if skip is None and not options:  # every guard stays (asked for, or an older torch)
        if mode is not None:
            kw["mode"] = mode
        return kw
    # mode and options cannot both be given: a mode is a named set of options
    if mode is not None:
        options = {**torch._inductor.list_mode_options(mode), **options}
    if skip is not None:
        options["guard_filter_fn"] = skip
    kw["options"] = options
    return kw


def cpu_wrapper_options() -> dict:
    """Inductor options for a CPU graph: its kernels called from C++ instead of a Python wrapper (`cpp_wrapper`),
    and no re-check of the inputs' sizes and strides that dynamo's guards have just checked (`size_asserts`). A
    launch-bound forward spends much of its time in that Python: measured on the project's 2-core CPU (overhead
    workload, interleaved calls in one process), the 8-layer draft's 3-token forward 0.77 -> 0.61 ms and the
    28-layer target's 5-token verify 3.0 -> 2.5 ms (dropping the asserts alone saved 5-7% of a call).
    The wrapper is built apart from the kernels (`cpp_wrapper_build_separate`): in one piece it compiled in 101 s
    against 46 s for the Python wrapper (the target's graph, from an empty cache), apart in 55 s, 4% slower a call.
    Same kernels, same results. On CUDA, graph replay (reduce-overhead) already skips the wrapper."""
    config = torch._inductor.config
    wanted = (("cpp_wrapper", True), ("cpp_wrapper_build_separate", True), ("size_asserts", False))
    return {name: value for name, value in wanted if hasattr(config, name)}


# Every read-modify-write of the buffers runs in inference mode, whatever the caller's mode and thread: they are
# inference tensors from their first write on, and one of those updated outside inference mode is an error (a later
# generate() under no_grad, or a worker thread, which does not inherit the caller's mode).
class Entry:
    @torch.inference_mode()
    def __init__(self, model: PreTrainedModel, key: tuple, batch: int, max_cache_len: int, dtype, device,
                 guard_modules: bool = True):
        self.key = key
        self.guard_modules = guard_modules  # compile_kwargs: False for a draft's entries (part of the key)
        self.model_ref = weakref.ref(model)
        self.batch, self.max_cache_len, self.dtype, self.device = batch, max_cache_len, dtype, device
        self.w = torch.zeros(batch, dtype=torch.long, device=device)
        # a spare column past the last slot (never used), as the K/V have (slot_step.SPARE_SLOTS): a view of the
        # first L slots is then never contiguous, whatever L, so a graph traced over all of them still serves views
        self.valid = torch.zeros(batch, max_cache_len + SPARE_SLOTS, dtype=torch.bool, device=device)[:, :max_cache_len]
        self.pos = torch.zeros(batch, max_cache_len + SPARE_SLOTS, dtype=torch.long, device=device)[:, :max_cache_len]
        self.alive = torch.ones(batch, dtype=torch.bool, device=device)
        self.slot_ids = torch.arange(max_cache_len, device=device)
        for t in (self.w, self.valid, self.pos, self.alive, self.slot_ids):
            torch._dynamo.mark_static_address(t)
        layers = model.config.get_text_config().num_hidden_layers
        self.cache = Cache(layers=[SlotLayer(max_cache_len, Pointer(self.w)) for _ in range(layers)])
        self.compiled: dict = {}  # width -> torch.compile'd copy of slot_step, built on first use
        self.compiled_widths: set[int] = set()  # widths whose graph exists
        self.compile_failed: str | None = None  # the last compile error, if any
        self.compile_failures: dict[int, int] = {}  # width -> compiles of it that failed
        self.failed_now: set[int] = set()  # widths that failed during this generation: eager until its end
        self.compile_s = 0.0  # total seconds spent compiling for this entry
        self.probe: dict[int, bool] = {}  # width -> compiled was faster (ssd_compile="auto")
        self.in_use = False

    @property
    def initialized(self) -> bool:
        return all(layer.is_initialized for layer in self.cache.layers)

    @torch.inference_mode()
    def reset(self) -> None:
        """Empty every row (in place: the buffers keep their addresses, so compiled graphs stay valid)."""
        self.w.zero_()
        self.valid.zero_()
        self.pos.zero_()
        self.alive.fill_(True)

    def may_compile(self, width: int) -> bool:
        """A width whose compile failed runs eagerly for the rest of that generation; the next one tries again,
        up to COMPILE_TRIES failures (a failure can be transient: dynamo tracing while another thread compiles or
        replays graphs once failed with "Failed to convert args/kwargs to proxy")."""
        return width not in self.failed_now and self.compile_failures.get(width, 0) < COMPILE_TRIES

    def compiled_step(self, width: int):
        """The compiled `slot_step` for forwards of `width` tokens per row: one code object per width, so each
        compiles once and no number of widths (plans the controller switches between) meets dynamo's recompile
        limit."""
        if width not in self.compiled:
            self.compiled[width] = torch.compile(_fresh_function(slot_step),
                                                 **compile_kwargs(self.device, self.guard_modules))
        return self.compiled[width]


_REGISTRY: dict[tuple, list[Entry]] = {}
_LOCK = threading.Lock()


def _forget(key: tuple) -> None:
    with _LOCK:
        _REGISTRY.pop(key, None)


REUSE_LARGER = 4  # a free entry up to this many times the slots asked for serves them (its graphs are compiled)


def acquire(model: PreTrainedModel, batch: int, max_cache_len: int, guard_modules: bool = True) -> Entry:
    """A free entry (reset) of at least these slots, or a new one. A larger free entry, up to REUSE_LARGER times,
    is taken before a new one is built: prompts of many lengths (each its own bucket) would otherwise compile every
    width again per bucket, seconds each, while attending over a few more empty slots costs little. Entries die
    with the model (weak reference)."""
    device = input_device(model)
    dtype = model.get_input_embeddings().weight.dtype
    key = (id(model), batch, max_cache_len, dtype, str(device), guard_modules)
    with _LOCK:
        entry = _free_entry(model, key)
        if entry is None:
            entries = _REGISTRY.get(key)
            if entries is not None and (not entries or entries[0].model_ref() is not model):
                entries = None  # a dead model's id reused
            if entries is None:
                entries = _REGISTRY[key] = []
                weakref.finalize(model, _forget, key)
            entry = Entry(model, key, batch, max_cache_len, dtype, device, guard_modules)
            entries.append(entry)
        entry.in_use = True
    entry.reset()
    entry.failed_now.clear()  # a new generation: widths whose compile failed once may try again
    return entry


def _free_entry(model: PreTrainedModel, key: tuple) -> Entry | None:
    """The smallest free entry of `model` with key's batch, dtype, device and guards and M to REUSE_LARGER·M
    slots."""
    model_id, batch, M, *rest = key
    fits = [e for k, es in _REGISTRY.items() for e in es
            if k[0] == model_id and k[1] == batch and list(k[3:]) == rest and M <= k[2] <= REUSE_LARGER * M
            and not e.in_use and e.model_ref() is model]
    return min(fits, key=lambda e: e.max_cache_len, default=None)


def release(entry: Entry) -> None:
    with _LOCK:
        entry.in_use = False


def registry_entries(model: PreTrainedModel | None = None) -> list[Entry]:
    """The registry's entries (of one model), for stats and tests."""
    with _LOCK:
        return [e for es in _REGISTRY.values() for e in es if model is None or e.model_ref() is model]


def clear(model: PreTrainedModel | None = None) -> int:
    """Drop the registry's free entries (of one model): their static buffers and compiled graphs. Returns how many."""
    with _LOCK:
        dropped = 0
        for key in list(_REGISTRY):
            entries = _REGISTRY[key]
            keep = [e for e in entries if e.in_use or (model is not None and e.model_ref() is not model)]
            dropped += len(entries) - len(keep)
            _REGISTRY[key] = keep
        return dropped
