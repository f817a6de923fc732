"""The draft model with a preallocated, static-shape KV cache: the draft side's per-round hot path without
allocation, concatenation, cropping or host reads, so it can run under torch.compile (CUDA graphs on GPU).

Layout. Every row owns slots 0..M-1 of a fixed [B, heads, M, head_dim] buffer per layer (M = max_cache_len). Row b
writes its next n tokens at its write pointer w[b] .. w[b]+n-1 (a per-row scatter) and moves the pointer on. Like
`CachedModel`, every slot has a validity bit and the logical position of its token, and every forward gets an
explicit 4D mask built from them, over the first L slots (a bucket holding every slot written so far, at most M:
`_slot_view`): left padding is a run of invalid slots, and so is everything at or past a row's pointer (invariant:
valid[b, s] is False for s >= w[b]). "Cropping" a row is moving its pointer back (`invalidate(start)`): a rejected
draft or a dropped tree branch is simply overwritten by the next round, so a row's committed tokens stay dense and M
only needs room for the longest sequence plus one round (glue K+1 slots and the tree K*N slots). Rows that finish
stay in the batch as dead rows: never valid, never advanced, their outputs dropped, so the batch shape never changes
either.

What a new token may see is given per query instead of as a [B, n, L+n] matrix (`SlotAttend`): every valid slot up
to `lim`, plus the valid slots of its own tree branch (slots tree0 + m*n + branch, m >= 0), plus itself. The
default (`attend=None`) is causal: lim = the token's own slot. A tree step of width n is lim = glue start + depth,
branch = the branch's index: exactly `core.tree.tree_attend`.

What compiles: one graph per hot width (the glue's K+1, the tree's N and the backup's single tokens per row),
`torch.compile(fullgraph=True, dynamic=False)`, "reduce-overhead" (CUDA graphs) on GPU: the mask over the view's
slots (the view's width marked dynamic), the whole model forward (every layer's slot-scatter KV write included) and
the validity/position/pointer updates. Checked with zero graph breaks on Llama, Qwen2, Qwen3, Gemma3 (mixed
sliding/full layers), Mistral (sliding window), GPT-2 (learned positions) and GPT-NeoX. What stays eager: prefill
(and any width a plan does not declare hot), and the small sync-free ops between forwards (fork, proposals, lookup).
Inputs are made dense first: graphs are specialised on strides.

The forward itself (mask, model, slot writes) is runtime/slot_step.py; the buffers and the compiled forward live in
a per-process registry keyed by (model, batch, M, dtype, device), runtime/static_registry.py, so a second
generate() with the same shapes reuses both (no re-allocation, no recompilation).
"""
from __future__ import annotations

import time
import warnings
import weakref

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import StaticLayer

from hf_ssd.runtime import static_registry
from hf_ssd.runtime.kv import (attention_layout, cache_argument, causal_prefill_family, input_device, layer_kv,
                               position_limit, prefill_logits_argument)
from hf_ssd.runtime.packed_attention import slot_view
from hf_ssd.runtime.slot_step import SlotAttend, dense, slot_step
from hf_ssd.runtime.static_registry import Entry, acquire, release

COMPILE_ENABLED = True  # False: the static path runs eagerly even when compile is asked for (debugging, tests)
BUCKET = 256  # the smallest M; larger ones are powers of two, so prompts of many lengths share buffers and graphs
# Compiled and eager slot forwards attend over a view of the first L slots, L = VIEW_BUCKET times a power of two
# (at most M) holding every slot written so far (`StaticCachedModel._slot_view`). False: over all M slots.
SLOT_VIEWS = True
VIEW_BUCKET = BUCKET


def bucketed(need: int, bucket: int) -> int:
    """The smallest `bucket` times a power of two that is >= need."""
    size = bucket
    while size < need:
        size *= 2
    return size


# The fewest slots a cache gets. Forwards read only a view of the slots in use (`_slot_view`), so a larger cache
# costs memory (and its first allocation), not attention; and every cache size compiles its own graphs. With 256,
# 512 and 1024 slots for the bench's prompts, `ssd=True` at α = 1 ran synchronous K=8 on the prompts whose sizes
# it had compiled that plan for and an SSD plan 0.65x as fast on the others (compiling K=8 again for them was
# priced at minutes of calls to repay). One size serves prompts up to ~900 tokens.
MIN_SLOTS = 1024


def static_cache_len(max_length: int, K: int, budget: int, bucket: int = BUCKET) -> int:
    """Slots a row needs: the longest sequence (prompt + new tokens), one round (glue K+1 + tree K*N) and a
    round of margin, rounded up to `bucket` times a power of two, and at least MIN_SLOTS. Each cache size compiles
    its own graphs (seconds per width on a CPU), and a free cache up to static_registry.REUSE_LARGER times larger
    serves a call: sizes in steps of 256 made prompts of many lengths compile again (an SSD plan compiled on the
    overhead workload's short MT-Bench prompts compiled for 10 s on its first HumanEval prompt), while powers of two
    need one or two sizes per workload."""
    return max(bucketed(int(max_length) + 2 * (K + 1) + K * int(budget), bucket), MIN_SLOTS)


# ---- the cache the draft side uses ----------------------------------------------------------------------------------
class StaticCachedModel:
    """`CachedModel`'s interface over static buffers (see the module doc). Slot indices are per row: `invalidate`,
    `write_pointer` and `SlotAttend` speak about row b's own slots 0..M-1."""

    static = True

    def __init__(self, model: PreTrainedModel, batch_size: int, max_cache_len: int, compile: bool = False,
                 hot_widths: tuple[int, ...] = (), guard_modules: bool = True):
        """guard_modules=False: compiled graphs skip dynamo's guards on the model's modules (the draft's; see
        static_registry.compile_kwargs)."""
        self.model = model
        self.slot_model = slot_view(model)  # the same weights, attention without a K/V copy per head (packed_attention)
        self.guard_modules = guard_modules
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
        # seconds its compiled calls took when they did not compile (host clock), per width: {tokens per row:
        # [seconds, calls]}
        self.width_run: dict[int, list] = {}
        self.max_position = position_limit(model)  # clamped as CachedModel clamps them (learned position tables)
        self._entry: Entry | None = None
        self._rows = list(range(batch_size))  # physical row of each row the caller sees
        self._rows_t: torch.Tensor | None = None  # the same on the device (None: every row)
        self._bound = 0  # host upper bound of every write pointer (never read from the device on the hot path)
        self._finalizer = None

    # ---- buffers --------------------------------------------------------------------------------------------------
    @property
    def entry(self) -> Entry:
        if self._entry is None:
            self._entry = acquire(self.model, self.batch, self.max_cache_len, self.guard_modules)
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
        inputs = [dense(x) for x in (tokens, positions, new_valid, lim, branch, tree0)]
        model = self.model if prefill else self.slot_model  # a prefill keeps transformers' own SDPA (and causal path)
        args = (model, e.cache, self.cache_kw, e.w, e.valid, e.pos, e.alive, e.slot_ids, *inputs,
                self.window, self.layer_types is not None, self.dtype, self.max_position)
        logits = self._prefill(e, n, args) if prefill else self._run(e, n, self._slot_view(args, n))
        self._bound += n
        self.forwards += 1
        return self._mine(logits)

    def _prefill(self, e: Entry, n: int, args) -> torch.Tensor:
        """An eager forward (the prompt) over the slots in use only: the first `_bound + n`, which hold every valid
        slot and the new tokens' (the host bound: no read from the device). The mask, validity and positions are
        views of those slots, and every layer's attention reads them alone (SlotLayer.view)."""
        L = min(self.max_cache_len, self._bound + n)
        model, cache, cache_kw, w, valid, pos, alive, slot_ids, *rest = args
        causal = self._bound == 0 and self._plain_causal(*rest[:4])
        for layer in cache.layers:
            layer.view = L
        try:
            return slot_step(model, cache, cache_kw, w, valid[:, :L], pos[:, :L], alive, slot_ids[:L], *rest,
                             self.prefill_kw, causal=causal)
        finally:
            for layer in cache.layers:
                layer.view = None

    @torch.inference_mode()
    def adopt_groups(self, parts: list, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Take a prompt prefilled in groups of rows (runtime.prefill: [(Group, CachedModel)]) as if its padded
        [B, n] `tokens` had been one forward at the empty cache's slots 0..n-1: each group's KV at its rows' slots
        start..n-1, validity and positions as given, every pointer at n."""
        e = self.entry
        if self._bound or self._rows_t is not None:
            raise RuntimeError("adopt_groups fills an empty cache of every row")
        n = tokens.shape[1]
        if self._bound + n > self.max_cache_len:
            raise RuntimeError(f"the static cache is full ({self.max_cache_len} slots)")
        for i, layer in enumerate(e.cache.layers):
            for group, part in parts:
                k, v = layer_kv(part.cache, i)
                if not layer.is_initialized:  # allocates [B, heads, slots, dim] like a first forward would
                    B = self.batch
                    layer.lazy_initialization(k.new_zeros(B, *k.shape[1:]), v.new_zeros(B, *v.shape[1:]))
                rows = torch.tensor(group.rows, device=layer.keys.device)
                layer.keys[rows, :, group.start:n] = k.to(layer.keys.dtype)
                layer.values[rows, :, group.start:n] = v.to(layer.values.dtype)
        e.valid[:, :n] = valid.to(self.device)
        e.pos[:, :n] = positions.to(self.device)
        e.w.add_(n)
        self._bound += n
        self.forwards += len(parts)

    def _plain_causal(self, tokens: torch.Tensor, positions: torch.Tensor, new_valid: torch.Tensor,
                      lim: torch.Tensor) -> bool:
        """May a prefill of an empty cache run with no mask (SDPA's causal kernel)? Only where the mask would be the
        plain causal one: every row's tokens valid (no left padding), alive and at positions 0..n-1 (the slots'
        order: a mask transformers builds from the positions is then the same), the default attention (lim = the
        token's own slot), full attention in every layer (no window), a model family checked against the masked
        path (tests/draft/test_static_draft.py), and a transformers that sizes the mask from the cache's layers."""
        if not causal_prefill_family(self.model, self.window, self.layer_types):
            return False
        if not hasattr(StaticLayer, "get_mask_sizes"):
            return False
        e = self.entry
        n = tokens.shape[1]
        own_slot = e.w[:, None] + e.slot_ids[:n]
        in_order = torch.equal(positions, e.slot_ids[:n].expand_as(positions))
        return bool(new_valid.all() and e.alive.all() and in_order and torch.equal(lim, own_slot))

    def _slot_view(self, args, n: int):
        """`args` with validity, positions and slot ids cut to the first L slots, L = the view bucket holding every
        slot written so far and the n new ones (the host bound: no device read). Slots past it are invalid (the
        module doc's invariant), so the mask over L slots gives the same logits, and packed_sdpa cuts K and V to
        the mask's width: attention reads L slots, not M. A cache lent to a shorter call (static_registry) or early
        in a long one is mostly empty: the overhead workload's compiled 9-token draft step took 0.85 ms on a
        256-slot view of a 1024-slot cache against 1.23 ms over all of it. The cut is marked dynamic, so one graph
        serves every view of a cache (on CUDA, a graph is recorded per view size: a few buckets), the whole cache
        included (L = M: the spare slot past the last, slot_step.SPARE_SLOTS, keeps that trace general). The model
        itself (no packed attention: slot_view) attends over all M."""
        if not SLOT_VIEWS or self.slot_model is self.model:
            return args
        L = min(bucketed(self._bound + n, VIEW_BUCKET), self.max_cache_len)
        model, cache, cache_kw, w, valid, pos, alive, slot_ids, *rest = args
        valid, pos, slot_ids = valid[:, :L], pos[:, :L], slot_ids[:L]
        torch._dynamo.mark_dynamic(valid, 1)
        torch._dynamo.mark_dynamic(pos, 1)
        torch._dynamo.mark_dynamic(slot_ids, 0)
        return (model, cache, cache_kw, w, valid, pos, alive, slot_ids, *rest)

    def _run(self, e: Entry, n: int, args) -> torch.Tensor:
        # The first forward of an entry is eager: the layers allocate (and mark static) their buffers outside a graph.
        if not (COMPILE_ENABLED and self.compile and n in self.hot_widths and e.initialized and e.may_compile(n)):
            return slot_step(*args)
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
            again = ("; the next generation tries again" if e.compile_failures[n] < static_registry.COMPILE_TRIES
                     else " again; it stays eager in this process")
            warnings.warn(f"hf_ssd: compiling the static-cache forward ({n} tokens per row) failed "
                          f"({_what_failed(e.compile_failed)}); this generation runs it eagerly{again}.",
                          RuntimeWarning, stacklevel=3)
            return slot_step(*args)
        dt = time.perf_counter() - t0
        if counters["stats"]["unique_graphs"] == graphs:
            at_width = self.width_run.setdefault(n, [0.0, 0])
            at_width[0] += dt
            at_width[1] += 1
        else:  # this call compiled (first call of the width, or again)
            e.compile_s += dt
            self.compile_s += dt
            static_registry.COMPILE_SPENT["seconds"] += dt
            static_registry.COMPILE_SPENT["graphs"] += 1
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


def _what_failed(message: str) -> str:
    """A compile error's first line, with dynamo's debug context (which call it could not trace, with what) and the
    innermost line of our code it was tracing, where it gives them: "Failed to convert args/kwargs to proxy" alone
    does not say what to look at."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    context = next((line for line in lines[1:] if "context:" in line.lower()), None)
    frames = [i for i, line in enumerate(lines) if i > 0 and line.startswith('File "')]
    frame = None
    if frames:  # the innermost frame, with its source line where dynamo printed one
        i = frames[-1]
        source = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("Set ") else ""
        frame = f"{lines[i]}: {source}" if source else lines[i]
    return "; ".join(x[:300] for x in lines[:1] + [x for x in (context, frame) if x])
