"""How long a stretch of work took on the device that ran it.

On a CPU the host clock is the device's. On CUDA, kernels run asynchronously: the host clock around a forward
times its launches (microseconds for a CUDA-graph replay), not its work, and a controller pricing trees and
verifies by it would find every tree nearly free. There a span is a pair of CUDA events recorded on the current
stream, read once the work is known to be done: after a host read the caller makes anyway (a verify's commit, a
lookup's hits), so timing adds no sync to the hot path.
"""
from __future__ import annotations

import time

import torch


class DeviceSpan:
    """Started on creation; `stop()` after the work is queued; `seconds()` once it is done (on CUDA it waits for the
    end event, so read it where the stream has been synchronized anyway)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.end: float | None = None
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
            # the work's own device's stream: with a target split over GPUs, or a draft on another one, the current
            # device's stream would time nothing of it
            self.start_event.record(torch.cuda.current_stream(self.device))
        else:
            self.start = time.perf_counter()

    def stop(self) -> DeviceSpan:
        if self.cuda:
            self.end_event.record(torch.cuda.current_stream(self.device))
        else:
            self.end = time.perf_counter()
        return self

    def seconds(self) -> float:
        if self.cuda:
            self.end_event.synchronize()
            return self.start_event.elapsed_time(self.end_event) / 1000.0  # CUDA events measure milliseconds
        if self.end is None:
            raise RuntimeError("DeviceSpan.seconds() before stop()")
        return self.end - self.start
