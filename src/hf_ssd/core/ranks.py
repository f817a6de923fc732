"""Under torch.distributed (a tensor-parallel target), every rank must take the same decisions: the ranks verify
together, so what they draft (plan, K, backup) must match, and their timings never do exactly."""
from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def distributed() -> bool:
    """Running under torch.distributed with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def from_rank0(value: T) -> T:
    """Rank 0's `value` on every rank (the value itself when not distributed)."""
    import torch.distributed as dist

    if not distributed():
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
