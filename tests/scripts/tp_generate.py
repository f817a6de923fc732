"""Run under torchrun: a tensor-parallel target (gloo on CPU), the draft a full copy outside the TP group.
Writes each rank's greedy SSD output to OUT_DIR/rank{N}.json."""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

import hf_ssd  # noqa: F401

model_dir, out_dir = sys.argv[1], sys.argv[2]
target = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
draft = AutoModelForCausalLM.from_pretrained(model_dir + "-draft", dtype=torch.float32)
ids = torch.tensor([[5, 9, 17, 33, 2, 41, 7]])
result = {}
for mode in ("sync", "ssd"):
    out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft, ssd=True, ssd_mode=mode,
                          ssd_worker="inline", ssd_budget=6)
    result[mode] = out[0].tolist()
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)
# Gloo's worker threads must stop before the interpreter does: exiting with a live process group can abort
# ("terminate called without an active exception") and fail the run after all its work is done.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
