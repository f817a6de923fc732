"""Python's cyclic garbage collector held off while the controller prices plans.

A decision builds a few thousand short-lived objects (a prediction per plan, with its parts) that all die by
reference count when it returns, and it makes no reference cycles. But while they live they push the collector's
youngest generation past its threshold again and again: on the overhead workload at batch 1 each `ssd=True` call
ran ~27 young-generation collections (0.3 ms each: a compiled model leaves a large heap behind) and ~2.5 middle
ones (3 ms each), where the same plan without the controller ran none; about 4% of the call. Once in those 12
calls the promoted survivors set off a full collection, which took 0.7 s inside the call. Paused, the temporaries
die uncollected and nothing is promoted.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def collections_paused():
    """No garbage collection in the block, or in the decorated function (objects still die by reference count);
    the caller's setting after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
