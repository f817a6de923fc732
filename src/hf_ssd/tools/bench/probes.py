"""What a bench run records about itself and its machine: time to first token, peak memory, the machine, the
package versions (so every table says where and with what it was measured)."""
from __future__ import annotations

import os
import platform
import sys
import threading
import time
from typing import Any

import torch


class FirstTokenTimer:
    """A stopping criterion that never stops and notes when generation produced its first token (TTFT)."""

    def __init__(self):
        self.first: float | None = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.first is None:
            self.first = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class PeakRSS:
    """Peak resident memory of this process while the block runs (psutil sampling every 20 ms; falls back to
    resource.getrusage's lifetime peak when psutil is missing)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self.source = interval, 0, "psutil"
        try:
            import psutil

            self._proc = psutil.Process()
        except ImportError:
            self._proc = None
            self.source = "resource.ru_maxrss (process lifetime)"

    def _sample(self) -> int:
        if self._proc is not None:
            try:
                return self._proc.memory_info().rss
            except Exception:
                return 0
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def __enter__(self):
        self._stop = threading.Event()
        self.peak = self._sample()

        def loop():
            while not self._stop.wait(self.interval):
                self.peak = max(self.peak, self._sample())

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._sample())
        return False


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    info["torch_threads_default"] = torch.get_num_threads()
    try:  # other processes on the same cores distort every timing: keep the load next to the numbers
        info["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for p in ("hf-ssd", "torch", "transformers", "accelerate", "datasets", "numpy", "matplotlib", "tqdm"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return out
