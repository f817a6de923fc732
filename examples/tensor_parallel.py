"""Tensor-parallel target, draft outside the target's group, under torchrun:

    torchrun --nproc-per-node 2 examples/tensor_parallel.py            # default pair (CPU: gloo; GPU: NCCL)
    torchrun --nproc-per-node 2 examples/tensor_parallel.py --tiny     # tiny random models

The target is sharded by transformers (`tp_plan="auto"`); the draft is an ordinary, unsharded model that every
rank holds for itself, so drafting never waits on the target's collectives. All ranks compute the same tokens
(greedy, or sampling with the same seed on every rank). Without torchrun it runs as a single process.
"""
import os
import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM

from _common import encode, load, parser

args = parser(__doc__).parse_args()
rank = int(os.environ.get("RANK", "0"))
reference_target, draft, tok, n = load(args)
tiny = args.tiny or os.environ.get("HF_SSD_TINY") == "1"
if tiny:
    path = tempfile.mkdtemp(prefix=f"hf-ssd-tp-{rank}-")  # every rank saves its identical copy
    reference_target.save_pretrained(path)
else:
    from hf_ssd.tools.assets import prepare

    [path] = prepare("qwen-1.5b")
tp = {"tp_plan": "auto"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}
target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **tp).eval()
if tiny:
    shutil.rmtree(path, ignore_errors=True)  # loaded: the saved copy is no longer needed

inputs = encode(tok, "Write a Python function that returns the n-th Fibonacci number.")
out = target.generate(**inputs, assistant_model=draft, ssd=True, max_new_tokens=n, do_sample=False,
                      return_dict_in_generate=True)
plain = reference_target.generate(**inputs, max_new_tokens=n, do_sample=False)
same = out.sequences.tolist() == plain.tolist()
print(f"rank {rank}: tensor parallel={bool(tp)}, hit rate={out.ssd_stats['hit_rate']}, identical to a "
      f"single-process target: {same}")
assert same
if torch.distributed.is_initialized():  # stop gloo/NCCL threads before exit, or the process may abort
    torch.distributed.destroy_process_group()
