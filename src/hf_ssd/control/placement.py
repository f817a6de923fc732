"""Where the draft runs when `ssd_draft_device="auto"`: beside the target, not on top of it.

SSD's draft side works while the target verifies, so it should own hardware the target does not use: a GPU outside
the target's `device_map` (the one with the most free memory that fits the draft), else the target's own device.
On a CPU-only machine the draft stays on the CPU and the controller splits the cores between the two sides when
that pays (control/costs.py `core_split`).
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_ssd.runtime.kv import input_device

HEADROOM = 1.25  # the draft's weights plus room for its KV cache and activations


def target_devices(target: PreTrainedModel) -> set[str]:
    """Devices holding the target: its accelerate `hf_device_map`, or the device of its weights."""
    device_map = getattr(target, "hf_device_map", None) or {}
    devices = set()
    for where in device_map.values():
        if isinstance(where, int):
            devices.add(f"cuda:{where}")
        elif where not in ("cpu", "disk"):
            devices.add(str(torch.device(where)))
    return devices or {str(input_device(target))}


def pick_gpu(used: set[str], free_bytes: dict[int, int], need_bytes: int) -> int | None:
    """The GPU index with the most free memory among those the target does not use and the draft fits on."""
    fits = [i for i, free in free_bytes.items() if f"cuda:{i}" not in used and free >= need_bytes * HEADROOM]
    return max(fits, key=lambda i: free_bytes[i]) if fits else None


def choose_draft_device(target: PreTrainedModel, draft: PreTrainedModel) -> torch.device:
    if torch.cuda.is_available():
        from accelerate.utils import compute_module_sizes, get_max_memory

        free = {i: b for i, b in get_max_memory().items() if isinstance(i, int)}
        gpu = pick_gpu(target_devices(target), free, compute_module_sizes(draft)[""])
        if gpu is not None:
            return torch.device("cuda", gpu)
    return input_device(target)
