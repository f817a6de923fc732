"""What the benchmark runs on: the model pair (real or tiny random), a byte tokenizer for the tiny pair, and prompt
batches from hf_ssd.tools.prompts."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hf_ssd.tools.bench.runner import BenchConfig

class ByteTokenizer:
    """A toy byte-level tokenizer for the --tiny random models: id = byte + 2, 0 = pad, 1 = eos."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 1
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return [b + 2 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) - 2 for i in ids if int(i) >= 2).decode("utf-8", errors="replace")


def tiny_pair(seed: int = 0):
    """Random tiny Qwen2 target + a noisy copy as draft (partial agreement), float32, eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = ByteTokenizer()
    cfg = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen the random logits so greedy decoding has clear argmaxes
        target.lm_head.weight.mul_(8.0)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * (p.std() if p.numel() > 1 else 1.0))
    for m in (target, draft):
        m.generation_config.pad_token_id = tok.pad_token_id
        m.generation_config.eos_token_id = tok.eos_token_id
    return target, draft, tok


def load_models(cfg: BenchConfig):
    """(target, draft, tokenizer, description dict)."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.tiny:
        t, d, tok = tiny_pair(cfg.seed)
        return t, d, tok, {"pair": "tiny (random Qwen2, 2 layers, hidden 64, byte vocab)", "dtype": "float32"}
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


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(x) for x in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, n - len(x):] = torch.tensor(x, dtype=torch.long)
        mask[i, n - len(x):] = 1
    return ids, mask


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
