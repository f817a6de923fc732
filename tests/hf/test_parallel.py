"""Targets split across devices: tensor parallel under torchrun (gloo, CPU) and accelerate offload."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_ssd  # noqa: F401
from hf_ssd.testing import shallow_copy, tiny_llama

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tp_generate.py"


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_llama(0, vocab_size=128, hidden_size=64, intermediate_size=128, eos_token_id=2, pad_token_id=None)
    draft = shallow_copy(target)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "target-draft")
    return root, target, draft


def test_tensor_parallel_target_matches_single_process(saved_pair, tmp_path):
    root, target, draft = saved_pair
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not found next to the interpreter")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}  # torchrun's own temp dirs
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-port", "29531", str(SCRIPT), str(root / "target"), str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.tensor([[5, 9, 17, 33, 2, 41, 7]])
    reference = target.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist()
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["sync"] == reference
        assert result["ssd"] == reference


def test_offloaded_target_device_map(saved_pair, tmp_path):
    """Part of the target on disk (accelerate offload, parameters on `meta`): inputs follow the embeddings."""
    root, target, draft = saved_pair
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32, device_map=device_map,
                                                     offload_folder=str(tmp_path / "offload"))
    assert offloaded.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    ids = torch.tensor([[5, 9, 17, 33, 2, 41, 7]])
    reference = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = offloaded.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft, ssd=True, ssd_budget=6)
    assert torch.equal(out, reference)
