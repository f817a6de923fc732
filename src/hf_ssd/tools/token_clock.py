"""A streamer that notes when each new token arrived, so a long answer's speed can be read over its first n tokens
and compared with a shorter run of another method on the same tokens (`hf-ssd demo`)."""
from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer


class TokenClock(BaseStreamer):
    """Pass as `streamer=` (batch 1). Start it right before `generate()`; `seconds_to(n)` is the time from the
    start until the n-th new token had arrived. The first `put` is the prompt (transformers' streamer protocol),
    not counted."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.arrivals: list[float] = []  # one wall time per new token
        self._seen_prompt = False
        self.started = time.perf_counter()

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        now = time.perf_counter()
        self.arrivals.extend([now] * int(value.numel()))

    def end(self) -> None:
        pass

    def seconds_to(self, n: int) -> float:
        if not 1 <= n <= len(self.arrivals):
            raise ValueError(f"the clock saw {len(self.arrivals)} new tokens; asked for the time to token {n}")
        return self.arrivals[n - 1] - self.started
