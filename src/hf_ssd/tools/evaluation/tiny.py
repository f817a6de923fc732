"""A tiny random target/draft pair and a byte-level tokenizer, built in memory (no download), for CI and `--tiny`.

The draft is the target with slightly perturbed weights, so it agrees with the target most of the time (speculation
is accepted and the cache hits) while still being a different model. Outputs are gibberish; only the mechanics count.
"""
from __future__ import annotations

import os

import torch


def tiny_requested(flag: bool = False) -> bool:
    """True when `--tiny` was given or the environment variable HF_SSD_TINY is set to a non-empty, non-0 value."""
    return flag or os.environ.get("HF_SSD_TINY", "") not in ("", "0")


def tiny_tokenizer():
    """GPT-2 style byte-level tokenizer with no merges: 256 byte tokens + <s>, </s>, <pad> (ids 256, 257, 258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for name in ("<s>", "</s>", "<pad>"):
        vocab[name] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   padding_side="left")


def tiny_pair(seed: int = 0, noise: float = 0.02, layers: int = 2, hidden: int = 64):
    """(target, draft, tokenizer): random Llama models sharing the tiny tokenizer, fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    for m in (target, draft):
        m.generation_config.pad_token_id = tok.pad_token_id
        m.generation_config.eos_token_id = tok.eos_token_id
        m.generation_config.bos_token_id = tok.bos_token_id
    return target, draft, tok
