"""What the benchmark runs on: the model pair (real, or hf_ssd.testing's tiny random pair) and prompt batches from
hf_ssd.tools.prompts."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hf_ssd.testing import tiny_pair

if TYPE_CHECKING:
    from hf_ssd.tools.bench.runner import BenchConfig


def load_models(cfg: BenchConfig):
    """(target, draft, tokenizer, description dict)."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.workload == "overhead":  # launch-bound stand-in, built from configs (see bench/overhead.py)
        from hf_ssd.tools.bench.overhead import describe, overhead_pair

        t, d, tok = overhead_pair(cfg.alpha_noise, seed=cfg.seed)
        return t, d, tok, {"pair": describe(cfg.alpha_noise), "dtype": "float32", "workload": "overhead"}
    if cfg.tiny:
        t, d, tok = tiny_pair(cfg.seed)
        return t, d, tok, {"pair": "tiny (random Llama, 2 layers, hidden 64, byte-level vocab)", "dtype": "float32"}
    if cfg.target or cfg.draft:
        if not (cfg.target and cfg.draft):
            raise ValueError("give both --target and --draft")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).eval()
        draft = AutoModelForCausalLM.from_pretrained(cfg.draft, dtype=dtype).eval()
        tok = AutoTokenizer.from_pretrained(cfg.target)
        return target, draft, tok, {"pair": f"{cfg.target} + {cfg.draft}", "dtype": cfg.dtype}
    from hf_ssd.tools.assets import PAIRS, load_default_pair, load_model

    if cfg.pair == "default":
        target, draft, tok = load_default_pair(dtype=dtype)
    else:
        spec = PAIRS[cfg.pair]
        if spec.draft is None:
            raise ValueError(f"pair {cfg.pair!r} has no draft model; use --pair default or --target/--draft")
        target, tok = load_model(spec.target, dtype)
        draft, _ = load_model(spec.draft, dtype)
    return target, draft, tok, {"pair": f"{cfg.pair}: {PAIRS[cfg.pair].description}", "dtype": cfg.dtype}


def load_bench_prompts(cfg: BenchConfig, tokenizer) -> list[dict[str, Any]]:
    """Prompts of every set as dicts id/set/category/prompt/input_ids (chat template applied, tokens capped)."""
    from hf_ssd.tools.prompts import format_chat, load_prompts

    rows = []
    for name in cfg.prompts:
        ds = load_prompts(name, cfg.num_prompts, seed=cfg.seed, max_chars=4000)
        for r in ds:
            text = format_chat(tokenizer, r["prompt"])
            ids = list(tokenizer.encode(text))
            if cfg.tiny:
                ids = ids[-min(cfg.max_prompt_tokens, 48):]  # keep CI runs to seconds
            else:
                ids = ids[-cfg.max_prompt_tokens:]
            rows.append({"id": r["id"], "set": name, "category": r["category"], "input_ids": ids})
    return rows


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos_ids: set[int]) -> list[list[int]]:
    """Generated tokens per row, cut after the first EOS (padding after it dropped)."""
    out = []
    for row in sequences[:, prompt_len:].tolist():
        toks = []
        for t in row:
            toks.append(int(t))
            if int(t) in eos_ids:
                break
        out.append(toks)
    return out
