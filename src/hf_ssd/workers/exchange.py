"""The process worker's per-round hand-over: fixed shared-memory buffers, written by one side, read by the other.

Allocated once per generation (after `start`, when the batch is known) and sent to the child once; from then on a
round only copies into and out of views of them, so no tensor, file descriptor or shared-memory segment is created
per round. Copies are single-threaded (numpy): on a busy machine torch's parallel copy of small tensors waits on
thread wake-ups longer than the copy takes.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from hf_ssd.core.types import DraftResult, Outcome, Speculation, Verdict

def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, single-threaded for CPU tensors: at these sizes (q is B*K*V floats) a parallel copy's thread
    wake-ups cost more than the copy, and much more on a loaded machine."""
    if src.shape != dst.shape:
        raise RuntimeError(f"hand-over shape {tuple(src.shape)} does not fit the buffer {tuple(dst.shape)}")
    if src.device.type == "cpu" and src.dtype == dst.dtype and src.dtype in _NUMPY_DTYPES:
        np.copyto(dst.numpy(), src.detach().numpy())
    else:
        dst.copy_(src)


def _copy_out(view: torch.Tensor) -> torch.Tensor:
    """A private copy of a buffer view (single-threaded, see _copy_into)."""
    if view.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(view.numpy().copy())
    return view.clone()


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.long, torch.int32, torch.bool)


class Exchange:
    """The per-round hand-over between parent and child: fixed shared-memory CPU tensors, allocated by the parent
    once per generation and sent to the child once; both sides address them through the same views.

    B rows (the generation's batch; rows shrink as they finish: a round uses the first B' rows), K draft slots,
    V vocabulary, C context capacity (grown, and sent again, when a context outgrows it).

    - begin (parent writes): tokens_in [B, K], n_in [B], source_in [B]. The speculation's q is not sent: the draft
      side only needs which tokens are being verified (the verifier, in the parent, needs q);
    - resolve (parent writes): accepted [B], bonus [B], keep [B], contexts [B, C] + lengths [B] (the n-gram
      backup reads the committed tokens; the prompt masks serve only a restart, which runs in the parent's chain);
    - result (child writes): tokens_out [B, K], n_out [B], source_out [B], q_out [B, K, V] (sampling only),
      hits [B].
    """

    INTS = ("tokens_in", "n_in", "source_in", "accepted", "bonus", "lengths", "tokens_out", "n_out", "source_out")
    FLAGS = ("keep", "hits")

    def __init__(self, B: int, K: int, V: int, q_dtype: torch.dtype | None, capacity: int,
                 tensors: tuple | None = None):
        self.B, self.K, self.V = B, K, V
        if tensors is None:  # the parent allocates
            ints = torch.zeros(sum(math.prod(s) for s in self._int_shapes()), dtype=torch.long).share_memory_()
            flags = torch.zeros(2 * B, dtype=torch.bool).share_memory_()
            q = None if q_dtype is None else torch.zeros(B, K, V, dtype=q_dtype).share_memory_()
            contexts = torch.zeros(B, capacity, dtype=torch.long).share_memory_()
            tensors = (ints, flags, q, contexts)
        self.tensors = tensors
        ints, flags, self.q_out, self.contexts = tensors
        at = 0
        for name, shape in zip(self.INTS, self._int_shapes()):
            size = math.prod(shape)
            setattr(self, name, ints[at: at + size].view(shape))
            at += size
        self.keep, self.hits = flags[:B], flags[B:]

    def _int_shapes(self) -> list[tuple[int, ...]]:
        B, K = self.B, self.K
        return [(B, K) if name.startswith("tokens") else (B,) for name in self.INTS]

    def message(self) -> tuple:
        """What the child needs to attach to the same memory (sent once, pickled through shared memory)."""
        return self.B, self.K, self.V, self.tensors

    @classmethod
    def attach(cls, B: int, K: int, V: int, tensors: tuple) -> Exchange:
        return cls(B, K, V, None, 0, tensors)

    @property
    def capacity(self) -> int:
        return self.contexts.shape[1]

    def grow(self, needed: int) -> torch.Tensor:
        """A larger shared contexts buffer (the caller sends it to the child)."""
        self.contexts = torch.zeros(self.B, max(needed, 2 * self.capacity), dtype=torch.long).share_memory_()
        self.tensors = (*self.tensors[:3], self.contexts)
        return self.contexts

    # ---- parent -> child ----------------------------------------------------------------------------------------
    def write_spec(self, spec: Speculation) -> int:
        B = spec.tokens.shape[0]
        _copy_into(self.tokens_in[:B], spec.tokens)
        _copy_into(self.n_in[:B], spec.n)
        _copy_into(self.source_in[:B], spec.source)
        return B

    def read_spec(self, B: int) -> Speculation:
        # copies: the drafter keeps the speculation until resolve, and the buffers are the next round's
        return Speculation(_copy_out(self.tokens_in[:B]), _copy_out(self.n_in[:B]), None,
                           _copy_out(self.source_in[:B]))

    def write_verdict(self, verdict: Verdict) -> tuple[int, int]:
        B, kept = verdict.keep.shape[0], len(verdict.contexts)
        _copy_into(self.accepted[:B], verdict.outcome.accepted)
        _copy_into(self.bonus[:B], verdict.outcome.bonus)
        _copy_into(self.keep[:B], verdict.keep)
        lengths = [c.shape[0] for c in verdict.contexts]
        for i, (c, n) in enumerate(zip(verdict.contexts, lengths)):
            _copy_into(self.contexts[i, :n], c)
        _copy_into(self.lengths[:kept], torch.tensor(lengths, dtype=torch.long))
        return B, kept

    def read_verdict(self, B: int, kept: int, verify_s: float) -> Verdict:
        outcome = Outcome(_copy_out(self.accepted[:B]), _copy_out(self.bonus[:B]))
        # contexts are views: the drafter reads them during resolve only (the n-gram backup)
        contexts = [self.contexts[i, :n] for i, n in enumerate(self.lengths[:kept].tolist())]
        return Verdict(outcome, _copy_out(self.keep[:B]), contexts, [], verify_s)

    # ---- child -> parent ----------------------------------------------------------------------------------------
    def write_result(self, result: DraftResult) -> tuple[int, bool, bool]:
        spec = result.spec
        rows = spec.tokens.shape[0]
        if spec.tokens.shape[1:] != (self.K,):
            raise RuntimeError(f"speculation of shape {tuple(spec.tokens.shape)} does not fit K={self.K}")
        _copy_into(self.tokens_out[:rows], spec.tokens)
        _copy_into(self.n_out[:rows], spec.n)
        _copy_into(self.source_out[:rows], spec.source)
        if spec.q is not None:
            if self.q_out is None or spec.q.dtype != self.q_out.dtype or spec.q.shape[1:] != self.q_out.shape[1:]:
                raise RuntimeError(f"q of {spec.q.dtype} {tuple(spec.q.shape)} does not fit the exchange buffer")
            _copy_into(self.q_out[:rows], spec.q)
        if result.hits is not None:
            _copy_into(self.hits[:rows], result.hits)
        return rows, spec.q is not None, result.hits is not None

    def read_result(self, rows: int, has_q: bool, has_hits: bool) -> tuple[Speculation, torch.Tensor | None]:
        # copies: the next round overwrites the buffers
        spec = Speculation(_copy_out(self.tokens_out[:rows]), _copy_out(self.n_out[:rows]),
                           _copy_out(self.q_out[:rows]) if has_q else None, _copy_out(self.source_out[:rows]))
        return spec, _copy_out(self.hits[:rows]) if has_hits else None
