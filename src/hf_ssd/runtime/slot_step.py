"""One forward over static slots: what the static caches (runtime/static_kv.py) run, eagerly or compiled.

Every row owns slots 0..M-1 of a fixed [B, heads, M, head_dim] buffer per layer; row b writes its next n tokens at
its write pointer w[b] .. w[b]+n-1 (`SlotLayer`: a per-row scatter) and every forward gets an explicit 4D mask over
the slots it is given (all M, or a view of the first L that holds every valid one: static_kv) built from each
slot's validity bit and logical position. What a new token may see is given per query
(`SlotAttend`), not as a [B, n, L+n] matrix. `slot_step` is that whole forward with fixed shapes in and out and no
host reads: what torch.compile sees.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import StaticLayer


class SlotAttend(NamedTuple):
    """What each new token may see (see module doc): valid slots <= lim, its branch's tree slots, itself."""

    lim: torch.Tensor  # [B, n] long
    branch: torch.Tensor  # [B, n] long, -1 = no branch
    tree0: torch.Tensor  # [B] long, first tree slot of each row


class Pointer:
    """The write pointers every layer of one cache shares: row b's next token goes to slot w[b]."""

    def __init__(self, w: torch.Tensor):
        self.w = w


# Physical K/V slots past the last one a row can use: never written, never read. A view of the first L slots is
# then never the whole buffer, so a compiled forward traced over all M slots does not learn that its K/V are
# contiguous (L == M): that guard tied the view's width to M, and each width was traced again at its first shorter
# view (static_kv.StaticCachedModel._slot_view).
SPARE_SLOTS = 1


class SlotLayer(StaticLayer):
    """A full-attention static layer whose writes go to per-row slots (the shared write pointers), not to one
    cumulative position. Sliding windows are applied in our masks, so every layer keeps all M slots."""

    is_sliding = False

    def __init__(self, max_cache_len: int, pointer: Pointer):
        super().__init__(max_cache_len=max_cache_len + SPARE_SLOTS)  # allocated lazily, with the spare
        self.slots = max_cache_len
        self.pointer = pointer
        # while set, attention reads only the first `view` slots: an eager prefill attends over the slots written so
        # far, not all M (a sync draft's cache has room for twice the call: its prefill read 2-4x the slots it needed)
        self.view: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, n, _ = key_states.shape
        slots = self.pointer.w[:, None] + torch.arange(n, device=self.keys.device)  # [B, n]
        index = slots[:, None, :, None]
        self.keys.scatter_(2, index.expand(B, H, n, self.k_head_dim), key_states.to(self.keys.dtype))
        self.values.scatter_(2, index.expand(B, H, n, self.v_head_dim), value_states.to(self.values.dtype))
        width = self.slots if self.view is None else self.view
        return self.keys[:, :, :width], self.values[:, :, :width]

    def get_mask_sizes(self, *args, **kwargs):
        """(kv length, offset) for a mask transformers builds itself: only a causal prefill lets it (slot_step with
        causal=True), over the `view` slots attention reads."""
        return (self.slots if self.view is None else self.view), 0

    def get_max_cache_shape(self) -> int:
        return self.slots


def slot_allowed(valid: torch.Tensor, lim: torch.Tensor, branch: torch.Tensor, tree0: torch.Tensor,
                 slot_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n, M] bool: the valid slots each of n new tokens may see (before the window and the token itself):
    slots <= lim, and its branch's tree slots tree0 + m*n + branch (m >= 0). See `SlotAttend`."""
    s = slot_ids[None, None, :]  # [1, 1, M]
    rel = s - tree0[:, None, None]
    allowed = (s <= lim[:, :, None]) | ((rel >= 0) & (torch.remainder(rel, n) == branch[:, :, None]))
    return allowed & valid[:, None, :]


def slot_step(model, cache, cache_kw, w, valid, pos, alive, slot_ids, tokens, positions, new_valid, lim, branch,
               tree0, window, mixed, dtype, max_position, head_kw=None, causal=False):
    """One forward of n tokens per row at the rows' write pointers: write validity and positions, build the mask
    over the slots `valid` spans, run the model (its layers write their KV at the same slots), advance live rows'
    pointers. Fixed shapes in, fixed shapes out, no host reads: this is what torch.compile sees.

    causal: the caller knows the mask is plain causal over exactly these tokens (an unpadded prefill of an empty
    cache, full attention, attention reading only the new slots): no mask is passed, so attention runs SDPA's
    causal kernel (a 716-token prompt's masked attention cost 1.5x the causal one). Eager prefills only."""
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

    if causal:
        attention_mask = None
    elif mixed:
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


def dense(x: torch.Tensor) -> torch.Tensor:
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
