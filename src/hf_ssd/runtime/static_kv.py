"""The draft model with a preallocated, static-shape KV cache: the draft side's per-round hot path without
allocation, concatenation, cropping or host reads, so it can run under torch.compile (CUDA graphs on GPU).

Layout. Every row owns slots 0..M-1 of a fixed [B, heads, M, head_dim] buffer per layer (M = max_cache_len). Row b
writes its next n tokens at its write pointer w[b] .. w[b]+n-1 (a per-row scatter) and moves the pointer on.
Like `CachedModel`, every slot has a validity bit and the logical position of its token, and every forward gets an
explicit 4D mask built from them, now over all M slots (a static shape): left padding is a run of invalid slots,
and so is everything at or past a row's pointer (invariant: valid[b, s] is False for s >= w[b]). "Cropping" a row
is moving its pointer back (`invalidate(start)`): a rejected draft or a dropped tree branch is simply overwritten
by the next round, so a row's committed tokens stay dense and M only needs room for the longest sequence plus one
round (glue K+1 slots and the tree K*N slots). Rows that finish stay in the batch as dead rows: never valid, never
advanced, their outputs dropped, so the batch shape never changes either.

What a new token may see is given per query instead of as a [B, n, L+n] matrix (`SlotAttend`): every valid slot up
to `lim`, plus the valid slots of its own tree branch (slots tree0 + m*n + branch, m >= 0), plus itself. The
default (`attend=None`) is causal: lim = the token's own slot. A tree step of width n is lim = glue start + depth,
branch = the branch's index: exactly `core.tree.tree_attend`.

What compiles: one graph per hot width (the glue's K+1, the tree's N and the backup's single tokens per row),
`torch.compile(fullgraph=True, dynamic=False)`, "reduce-overhead" (CUDA graphs) on GPU: the mask over all M slots,
the whole model forward (every layer's slot-scatter KV write included) and the validity/position/pointer updates.
Checked with zero graph breaks on Llama, Qwen2, Qwen3, Gemma3 (mixed sliding/full layers), Mistral (sliding
window), GPT-2 (learned positions) and GPT-NeoX. What stays eager: prefill (and any width a plan does not declare hot),
and the small sync-free ops between forwards (fork, proposals, lookup). Inputs are made dense first:
graphs are specialised on strides.

The buffers and the compiled forward live in a per-process registry keyed by (model, batch, M, dtype, device), so a
second generate() with the same shapes reuses both (no re-allocation, no recompilation); `clear()` frees them.
"""
from __future__ import annotations

import threading
import time
import types
import warnings
import weakref
from typing import NamedTuple

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from hf_ssd.runtime.kv import attention_layout, cache_argument, input_device, position_limit, prefill_logits_argument

# seconds spent compiling and graphs built, all entries of this process together: what a new graph costs here
COMPILE_SPENT = {"seconds": 0.0, "graphs": 0}
COMPILE_TRIES = 2  # a width whose compile failed this many times runs eagerly for the life of the process
COMPILE_ENABLED = True  # False: the static path runs eagerly even when compile is asked for (debugging, tests)
BUCKET = 256  # M is rounded up to a multiple of this, so prompts of similar length share buffers and graphs


def static_cache_len(max_length: int, K: int, budget: int, bucket: int = BUCKET) -> int:
    """Slots a row needs: the longest sequence (prompt + new tokens), one round (glue K+1 + tree K*N) and a
    round of margin, rounded up to a multiple of `bucket`."""
    need = int(max_length) + 2 * (K + 1) + K * int(budget)
    return -(-need // bucket) * bucket


class SlotAttend(NamedTuple):
    """What each new token may see (see module doc): valid slots <= lim, its branch's tree slots, itself."""

    lim: torch.Tensor  # [B, n] long
    branch: torch.Tensor  # [B, n] long, -1 = no branch
    tree0: torch.Tensor  # [B] long, first tree slot of each row


class _Pointer:
    """The write pointers every layer of one cache shares: row b's next token goes to slot w[b]."""

    def __init__(self, w: torch.Tensor):
        self.w = w


class SlotLayer(StaticLayer):
    """A full-attention static layer whose writes go to per-row slots (the shared write pointers), not to one
    cumulative position. Sliding windows are applied in our masks, so every layer keeps all M slots."""

    is_sliding = False

    def __init__(self, max_cache_len: int, pointer: _Pointer):
        super().__init__(max_cache_len=max_cache_len)
        self.pointer = pointer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, n, _ = key_states.shape
        slots = self.pointer.w[:, None] + torch.arange(n, device=self.keys.device)  # [B, n]
        index = slots[:, None, :, None]
        self.keys.scatter_(2, index.expand(B, H, n, self.k_head_dim), key_states.to(self.keys.dtype))
        self.values.scatter_(2, index.expand(B, H, n, self.v_head_dim), value_states.to(self.values.dtype))
        return self.keys, self.values


def slot_allowed(valid: torch.Tensor, lim: torch.Tensor, branch: torch.Tensor, tree0: torch.Tensor,
                 slot_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n, M] bool: the valid slots each of n new tokens may see (before the window and the token itself):
    slots <= lim, and its branch's tree slots tree0 + m*n + branch (m >= 0). See `SlotAttend`."""
    s = slot_ids[None, None, :]  # [1, 1, M]
    rel = s - tree0[:, None, None]
    allowed = (s <= lim[:, :, None]) | ((rel >= 0) & (torch.remainder(rel, n) == branch[:, :, None]))
    return allowed & valid[:, None, :]


def _slot_step(model, cache, cache_kw, w, valid, pos, alive, slot_ids, tokens, positions, new_valid, lim, branch,
               tree0, window, mixed, dtype, max_position, head_kw=None):
    """One forward of n tokens per row at the rows' write pointers: write validity and positions, build the mask
    over all M slots, run the model (its layers write their KV at the same slots), advance live rows' pointers.
    Fixed shapes in, fixed shapes out, no host reads: this is what torch.compile sees."""
    n = tokens.shape[1]
    slots = w[:, None] + slot_ids[:n]  # [B, n]
    new_valid = new_valid & alive[:, None]
    valid_now = valid.scatter(1, slots, new_valid)
    pos_now = pos.scatter(1, slots, positions)
    allowed = slot_allowed(valid_now, lim, branch, tree0, slot_ids, n)
    own = slot_ids[None, None, :] == slots[:, :, None]

    def mask(win):
        a = allowed
        if win is not None:
            a = a & ((positions[:, :, None] - pos_now[:, None, :]) < win)
        a = a | own  # every query sees at least itself, so padded queries never produce NaNs
        return torch.zeros(a.shape, dtype=dtype, device=a.device).masked_fill_(~a, torch.finfo(dtype).min)[:, None]

    if mixed:
        attention_mask = {"full_attention": mask(None), "sliding_attention": mask(window)}
    else:
        attention_mask = mask(window)
    model_positions = positions if max_position is None else positions.clamp_max(max_position - 1)
    out = model(input_ids=tokens, position_ids=model_positions, attention_mask=attention_mask, use_cache=True,
                **{cache_kw: cache}, **(head_kw or {}))
    valid.copy_(valid_now)
    pos.copy_(pos_now)
    w.add_(alive.long() * n)
    return out.logits.float()


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x with the standard row-major strides, as an inference tensor (called in inference mode). Compiled graphs are
    specialised on exact strides and on dispatch keys: a sliced or expanded input (even one `is_contiguous()` calls
    contiguous, e.g. [1, n] with stride (n+1, 1)), or a caller's tensor made outside inference mode, would compile
    again."""
    expected, step = [], 1
    for size in reversed(x.shape):
        expected.append(step)
        step *= size
    if tuple(reversed(expected)) == x.stride() and x.is_inference():
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _fresh_function(fn):
    """A copy of `fn` with its own code object: dynamo keeps compiled graphs (and counts recompilations) per code
    object, so each cache entry (and width) gets its own graphs and its own recompile limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_mode(device: torch.device) -> str | None:
    """CUDA graphs on GPU; inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


# ---- the registry: buffers and compiled graphs, once per (model, shapes, dtype, device) per process -------------------
# Every read-modify-write of the buffers runs in inference mode, whatever the caller's mode and thread: they are
# inference tensors from their first write on, and one of those updated outside inference mode is an error (a later
# generate() under no_grad, or a worker thread, which does not inherit the caller's mode).
class _Entry:
    @torch.inference_mode()
    def __init__(self, model: PreTrainedModel, key: tuple, batch: int, max_cache_len: int, dtype, device):
        self.key = key
        self.model_ref = weakref.ref(model)
        self.batch, self.max_cache_len, self.dtype, self.device = batch, max_cache_len, dtype, device
        self.w = torch.zeros(batch, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, max_cache_len, dtype=torch.bool, device=device)
        self.pos = torch.zeros(batch, max_cache_len, dtype=torch.long, device=device)
        self.alive = torch.ones(batch, dtype=torch.bool, device=device)
        self.slot_ids = torch.arange(max_cache_len, device=device)
        for t in (self.w, self.valid, self.pos, self.alive, self.slot_ids):
            torch._dynamo.mark_static_address(t)
        layers = model.config.get_text_config().num_hidden_layers
        self.cache = Cache(layers=[SlotLayer(max_cache_len, _Pointer(self.w)) for _ in range(layers)])
        self.compiled: dict = {}  # width -> torch.compile'd copy of _slot_step, built on first use
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
        """The compiled `_slot_step` for forwards of `width` tokens per row: one code object per width, so each
        compiles once and no number of widths (plans the controller switches between) meets dynamo's recompile
        limit."""
        if width not in self.compiled:
            kw = {"fullgraph": True, "dynamic": False}
            mode = compile_mode(self.device)
            if mode is not None:
                kw["mode"] = mode
            self.compiled[width] = torch.compile(_fresh_function(_slot_step), **kw)
        return self.compiled[width]


_REGISTRY: dict[tuple, list[_Entry]] = {}
_LOCK = threading.Lock()


def _forget(key: tuple) -> None:
    with _LOCK:
        _REGISTRY.pop(key, None)


REUSE_LARGER = 4  # a free entry up to this many times the slots asked for serves them (its graphs are compiled)


def acquire(model: PreTrainedModel, batch: int, max_cache_len: int) -> _Entry:
    """A free entry (reset) of at least these slots, or a new one. A larger free entry, up to REUSE_LARGER times,
    is taken before a new one is built: prompts of many lengths (each its own bucket) would otherwise compile every
    width again per bucket, seconds each, while attending over a few more empty slots costs little. Entries die
    with the model (weak reference)."""
    device = input_device(model)
    dtype = model.get_input_embeddings().weight.dtype
    key = (id(model), batch, max_cache_len, dtype, str(device))
    with _LOCK:
        entry = _free_entry(model, key)
        if entry is None:
            entries = _REGISTRY.get(key)
            if entries is not None and (not entries or entries[0].model_ref() is not model):
                entries = None  # a dead model's id reused
            if entries is None:
                entries = _REGISTRY[key] = []
                weakref.finalize(model, _forget, key)
            entry = _Entry(model, key, batch, max_cache_len, dtype, device)
            entries.append(entry)
        entry.in_use = True
    entry.reset()
    entry.failed_now.clear()  # a new generation: widths whose compile failed once may try again
    return entry


def _free_entry(model: PreTrainedModel, key: tuple) -> _Entry | None:
    """The smallest free entry of `model` with key's batch, dtype and device and M to REUSE_LARGER·M slots."""
    model_id, batch, M, dtype, device = key
    fits = [e for k, es in _REGISTRY.items() for e in es
            if k[0] == model_id and k[1] == batch and k[3:] == (dtype, device) and M <= k[2] <= REUSE_LARGER * M
            and not e.in_use and e.model_ref() is model]
    return min(fits, key=lambda e: e.max_cache_len, default=None)


def release(entry: _Entry) -> None:
    with _LOCK:
        entry.in_use = False


def registry_entries(model: PreTrainedModel | None = None) -> list[_Entry]:
    """The registry's entries (of one model), for stats and tests."""
    with _LOCK:
        return [e for es in _REGISTRY.values() for e in es if model is None or e.model_ref() is model]


# ---- the cache the draft side uses ----------------------------------------------------------------------------------
class StaticCachedModel:
    """`CachedModel`'s interface over static buffers (see the module doc). Slot indices are per row: `invalidate`,
    `write_pointer` and `SlotAttend` speak about row b's own slots 0..M-1."""

    static = True

    def __init__(self, model: PreTrainedModel, batch_size: int, max_cache_len: int, compile: bool = False,
                 hot_widths: tuple[int, ...] = ()):
        self.model = model
        self.device = input_device(model)
        self.dtype = model.get_input_embeddings().weight.dtype
        self.layer_types, self.window = attention_layout(model)
        self.cache_kw = cache_argument(model)
        self.prefill_kw = prefill_logits_argument(model)
        self.batch, self.max_cache_len = batch_size, max_cache_len
        self.compile = compile
        self.hot_widths = set(hot_widths)  # forwards of these widths run compiled (when compile is on)
        self.forwards = 0
        self.compile_s = 0.0  # seconds this cache spent compiling (first call of each hot width)
        self.compiled_calls = 0
        self.max_position = position_limit(model)  # clamped as CachedModel clamps them (learned position tables)
        self._entry: _Entry | None = None
        self._rows = list(range(batch_size))  # physical row of each row the caller sees
        self._rows_t: torch.Tensor | None = None  # the same on the device (None: every row)
        self._bound = 0  # host upper bound of every write pointer (never read from the device on the hot path)
        self._finalizer = None

    # ---- buffers --------------------------------------------------------------------------------------------------
    @property
    def entry(self) -> _Entry:
        if self._entry is None:
            self._entry = acquire(self.model, self.batch, self.max_cache_len)
            self.max_cache_len = self._entry.max_cache_len  # a larger entry may serve (acquire)
            self._finalizer = weakref.finalize(self, release, self._entry)
        return self._entry

    def release(self) -> None:
        """Hand the buffers back to the registry (the next generation with these shapes reuses them)."""
        if self._finalizer is not None:
            self._finalizer()
        self._entry = None

    def _full(self, x: torch.Tensor, fill) -> torch.Tensor:
        """[B', ...] rows the caller sees -> [B, ...] physical rows (dead rows get `fill`)."""
        if self._rows_t is None:
            return x
        out = x.new_full((self.batch, *x.shape[1:]), fill)
        out[self._rows_t] = x
        return out

    def _mine(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._rows_t is None else x[self._rows_t]

    # ---- CachedModel's interface ----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Host upper bound of the slots any row has written (exact after `trim`)."""
        return self._bound

    @property
    def valid(self) -> torch.Tensor:
        return self._mine(self.entry.valid)

    @property
    def pos(self) -> torch.Tensor:
        return self._mine(self.entry.pos)

    def write_pointer(self) -> torch.Tensor:
        """[B'] slot each row writes next (a copy)."""
        w = self.entry.w
        return w.clone() if self._rows_t is None else w[self._rows_t]

    def next_position(self) -> torch.Tensor:
        """[B'] logical position of each row's next token (one past its last valid slot)."""
        e = self.entry
        nxt = torch.where(e.valid, e.pos + 1, torch.zeros_like(e.pos)).amax(dim=1)
        return self._mine(nxt)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, new_valid: torch.Tensor | None = None,
                attend: SlotAttend | None = None, prefill: bool = False) -> torch.Tensor:
        """Run `tokens` [B', n] at logical `positions` at each row's write pointer; return float32 logits [B', n, V].

        attend: a SlotAttend in the caller's rows, or None for causal attention over the row's valid slots.
        prefill: a one-off width (the prompt) that runs eagerly even if it equals a compiled width."""
        e = self.entry
        n = tokens.shape[1]
        if self._bound + n > self.max_cache_len:
            raise RuntimeError(
                f"the static draft cache is full ({self.max_cache_len} slots); it is sized from max_length, K and "
                "the budget at the start of the generation")
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        if new_valid is None:
            new_valid = torch.ones_like(tokens, dtype=torch.bool)
        tokens, positions = self._full(tokens, 0), self._full(positions, 0)
        new_valid = self._full(new_valid.to(self.device), False)
        if attend is None:
            lim = e.w[:, None] + e.slot_ids[:n]  # causal: up to the token's own slot
            branch = torch.full_like(lim, -1)
            tree0 = torch.full_like(e.w, self.max_cache_len)  # no tree slots (and no alias of w: one graph)
        else:
            lim, branch = self._full(attend.lim, -1), self._full(attend.branch, -1)
            tree0 = self._full(attend.tree0, self.max_cache_len)
        inputs = [_dense(x) for x in (tokens, positions, new_valid, lim, branch, tree0)]
        args = (self.model, e.cache, self.cache_kw, e.w, e.valid, e.pos, e.alive, e.slot_ids, *inputs,
                self.window, self.layer_types is not None, self.dtype, self.max_position)
        logits = _slot_step(*args, self.prefill_kw) if prefill else self._run(e, n, args)
        self._bound += n
        self.forwards += 1
        return self._mine(logits)

    def _run(self, e: _Entry, n: int, args) -> torch.Tensor:
        # The first forward of an entry is eager: the layers allocate (and mark static) their buffers outside a graph.
        if not (COMPILE_ENABLED and self.compile and n in self.hot_widths and e.initialized and e.may_compile(n)):
            return _slot_step(*args)
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        try:
            logits = e.compiled_step(n)(*args)
        except Exception as exc:  # noqa: BLE001 - compiling is an optimisation: run eager and say so once
            if n in e.compiled_widths:
                raise  # it ran before: this is not a compile failure
            e.compile_failed = f"{type(exc).__name__}: {exc}"
            e.compile_failures[n] = e.compile_failures.get(n, 0) + 1
            e.failed_now.add(n)
            e.compiled.pop(n, None)  # the next try starts from a fresh function
            again = ("; the next generation tries again" if e.compile_failures[n] < COMPILE_TRIES
                     else " again; it stays eager in this process")
            warnings.warn(f"hf_ssd: compiling the static-cache forward ({n} tokens per row) failed "
                          f"({e.compile_failed.splitlines()[0][:300]}); this generation runs it eagerly{again}.",
                          RuntimeWarning, stacklevel=3)
            return _slot_step(*args)
        if counters["stats"]["unique_graphs"] != graphs:  # this call compiled (first call of the width, or again)
            dt = time.perf_counter() - t0
            e.compile_s += dt
            self.compile_s += dt
            COMPILE_SPENT["seconds"] += dt
            COMPILE_SPENT["graphs"] += 1
        e.compiled_widths.add(n)
        self.compiled_calls += 1
        if e.device.type == "cuda":  # a CUDA graph's output is overwritten by its next replay: keep a copy
            logits = logits.clone()
        return logits

    def precompile(self, progress: bool = False) -> None:
        """Compile every hot width now, on an empty cache, rather than at its first use mid-generation: which widths a
        generation meets can depend on timing (the backup policy picks the JIT backup, width 1, from measured costs),
        and a graph built inside a round would stall it for seconds. Does nothing once all are compiled."""
        e = self.entry
        todo = sorted(w for w in self.hot_widths - e.compiled_widths if e.may_compile(w))
        if not (COMPILE_ENABLED and self.compile and todo):
            return
        from tqdm.auto import tqdm

        B = self.batch
        with torch.inference_mode():
            if not e.initialized:  # the first forward allocates the layers' buffers, eagerly
                one = torch.zeros(B, 1, dtype=torch.long, device=self.device)
                self.forward(one, one)
            for n in tqdm(todo, desc="hf_ssd: compiling the draft", unit="shape", disable=not progress):
                e.reset()
                self._bound = 0
                positions = torch.arange(n, device=self.device)[None].expand(B, n)
                self.forward(torch.zeros(B, n, dtype=torch.long, device=self.device), positions)
        e.reset()
        self._bound = 0
        self.forwards = self.compiled_calls = 0

    @torch.inference_mode()
    def invalidate(self, start: torch.Tensor, stop: int | None = None) -> None:
        """Without `stop`: move each row's pointer back to start[b] (slots from there on become invalid and are
        overwritten later). With `stop`: mark slots start[b] .. stop-1 as holes."""
        e = self.entry
        start = self._full(start.to(self.device), self.max_cache_len)  # dead rows: nothing to do
        if stop is None:
            torch.minimum(e.w, start, out=e.w)
            e.valid &= e.slot_ids[None, :] < e.w[:, None]
        else:
            s = e.slot_ids[None, :]
            e.valid &= ~((s >= start[:, None]) & (s < stop))

    @torch.inference_mode()
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, keep: torch.Tensor) -> None:
        """Per row, copy the KV and position of slots src[b, j] to slots dst[b, j] ([B', J] each; gathered before
        anything is written, so the two may overlap) and make dst[b, j] valid where keep[b, j]. A source slot may be
        past the write pointer (a dropped tree branch: invalid, but its KV is still there until overwritten).
        Entries with keep False go to a slot the caller knows is free and leave validity alone (a row with nothing to
        copy passes src == dst)."""
        e = self.entry
        src, dst = self._full(src.to(self.device), 0), self._full(dst.to(self.device), 0)
        keep = self._full(keep.to(self.device), False)
        for layer in e.cache.layers:
            for buf in (layer.keys, layer.values):
                B, H, _, D = buf.shape
                moved = buf.gather(2, src[:, None, :, None].expand(B, H, src.shape[1], D))
                buf.scatter_(2, dst[:, None, :, None].expand(B, H, dst.shape[1], D), moved)
        e.pos.scatter_(1, dst, e.pos.gather(1, src))
        e.valid.scatter_(1, dst, e.valid.gather(1, dst) | keep)

    @torch.inference_mode()
    def set_pointer(self, w: torch.Tensor) -> None:
        """Move each row's write pointer to w[b] (forward or back; slots from there on must already be invalid,
        which `copy_slots` into slots below w keeps true)."""
        e = self.entry
        w = w.to(self.device)
        if self._rows_t is None:
            e.w.copy_(w)
        else:
            e.w[self._rows_t] = w
        e.valid &= e.slot_ids[None, :] < e.w[:, None]

    def trim(self) -> None:
        """Nothing to crop; refresh the host bound of the write pointers (one host read: call it off the hot path)."""
        self._bound = int(self.entry.w.max())

    def crop_to(self, length: int) -> None:
        self.invalidate(torch.full((len(self._rows),), length, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the caller's rows `rows` (in order); the others become dead rows of the fixed batch."""
        keep = rows.tolist()
        if len(keep) != len(self._rows):
            e = self.entry
            self._rows = [self._rows[i] for i in keep]
            self._rows_t = torch.tensor(self._rows, dtype=torch.long, device=self.device)
            alive = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
            alive[self._rows_t] = True
            e.alive.copy_(alive)
        self.trim()


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
