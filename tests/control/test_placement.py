"""ssd_draft_device="auto": the draft goes to hardware the target leaves free."""
from __future__ import annotations

import torch

from hf_ssd.control.placement import pick_gpu, target_devices
from hf_ssd.testing import get_pair, plain_generate, prompt

GB = 1 << 30


def test_picks_the_free_gpu_with_most_memory_outside_the_targets_map():
    assert pick_gpu({"cuda:0", "cuda:1"}, {0: 80 * GB, 1: 80 * GB, 2: 10 * GB, 3: 40 * GB}, 2 * GB) == 3


def test_no_gpu_when_the_draft_does_not_fit_or_all_are_taken():
    assert pick_gpu({"cuda:0"}, {0: 80 * GB, 1: 1 * GB}, 2 * GB) is None
    assert pick_gpu({"cuda:0", "cuda:1"}, {0: 80 * GB, 1: 80 * GB}, 2 * GB) is None


def test_target_devices_from_device_map():
    class Mapped(torch.nn.Module):
        hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": "cpu", "model.norm": "disk"}

    assert target_devices(Mapped()) == {"cuda:0", "cuda:1"}
    assert target_devices(get_pair("llama").target) == {"cpu"}


def test_auto_on_a_cpu_machine_keeps_the_draft_on_the_cpu_and_is_exact():
    pair = get_pair("llama")
    ids = prompt(6, seed=4)
    out = pair.target.generate(ids, assistant_model=pair.related, ssd=True, ssd_draft_device="auto",
                               max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, plain_generate(pair.target, ids, max_new_tokens=10))
    assert pair.related.get_input_embeddings().weight.device.type == "cpu"
