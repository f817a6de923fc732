"""The overhead-bound workload (`hf-ssd bench --workload overhead`): a CPU stand-in for the GPU regime.

On a GPU at batch 1 a 1.5B/0.5B pair's steps are short (milliseconds) and dominated by fixed per-op costs, not by
FLOPs the way they are on this CPU; with launches removed (CUDA graphs) a step costs about its weight bytes, so the
0.5B draft costs about a third of the 1.5B target. This workload reproduces that regime on a CPU: real layer
counts at tiny widths, a 28-layer Qwen2 target (the 1.5B's depth) at hidden 64 (4 heads, 2 KV heads), where a
forward is per-op overhead and its cost follows the layer count, and an 8-layer draft, so the draft/target step
cost is about 8/28 ≈ 0.29, near the real pair's ratio once launches are gone. Built from configs in about a second,
no download: runnable in CI.

Acceptance is set by construction, not by luck:
- the target's layers 8..27 add nothing: their ``o_proj`` and ``down_proj`` weights are zero, so the residual stream
  passes through them unchanged (they still cost their full compute);
- the draft is a copy of the target's first 8 layers with the same embeddings, final norm and lm_head, so with
  ``alpha_noise=0`` draft and target compute the same logits: α = 1, greedy SD/SSD accepts every drafted token;
- ``alpha_noise`` > 0 adds seeded Gaussian noise (that many times each weight tensor's standard deviation) to every
  draft weight, which lowers α; ``alpha_noise=0.014`` gives α ≈ 0.7 (see ALPHA_NOISE_TABLE; α is `alpha_est` in
  the bench report: a property of the models, not of timing).

Decoding is fixed-length (no EOS: ``eos_token_id=None``, like ``ignore_eos`` in serving benchmarks), so every method
makes exactly max_new_tokens tokens per row.
"""
from __future__ import annotations

import torch

TARGET_LAYERS = 28
DRAFT_LAYERS = 8
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
# Weight init std: 0.2 gives varied greedy text (about 50 distinct tokens in 64) with logit gaps far above fp32
# rounding; transformers' default 0.02 collapses every prompt into a one- or two-token loop, which would flatter prompt
# lookup and the SSD cache.
INIT_RANGE = 0.2

# alpha_noise -> measured per-token acceptance α (alpha_est of `hf-ssd bench --workload overhead --methods sd
# --alpha-noise X --prompts 4 --max-new-tokens 64 --repeats 1`: greedy, K = 4, 4 HumanEval prompts x 64 tokens,
# seed 0). MT-Bench / ShareGPT prompts accept a little less (0.012 -> 0.67, 0.014 -> 0.65 there).
ALPHA_NOISE_TABLE: dict[float, float] = {0.0: 1.0, 0.003: 0.94, 0.006: 0.88, 0.01: 0.78, 0.012: 0.74, 0.014: 0.70,
                                         0.02: 0.59, 0.05: 0.27, 0.1: 0.10}


def _tokenizer():
    """hf_ssd.testing's byte-level toy tokenizer (256 bytes + <s>, </s>, <pad>): any prompt text encodes."""
    from hf_ssd.testing import byte_tokenizer

    return byte_tokenizer()


def _vocab_size(tok) -> int:
    return len(tok) if hasattr(tok, "__len__") else int(tok.vocab_size)


def _config(vocab: int, pad_id: int, layers: int, hidden: int, heads: int, kv_heads: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                       initializer_range=INIT_RANGE, bos_token_id=None, eos_token_id=None, pad_token_id=pad_id,
                       tie_word_embeddings=False)


def overhead_pair(alpha_noise: float = 0.0, seed: int = 0, target_layers: int = TARGET_LAYERS,
                  draft_layers: int = DRAFT_LAYERS, hidden: int = HIDDEN, heads: int = HEADS,
                  kv_heads: int = KV_HEADS):
    """(target, draft, tokenizer): the 28-layer target whose layers draft_layers.. add nothing, and its first
    `draft_layers` layers as the draft (noised by `alpha_noise`, seeded by seed + 1). float32, eval mode."""
    from transformers import Qwen2ForCausalLM

    if not 0 < draft_layers <= target_layers:
        raise ValueError(f"need 0 < draft_layers <= target_layers, got {draft_layers} and {target_layers}")
    if alpha_noise < 0:
        raise ValueError(f"alpha_noise must be >= 0, got {alpha_noise}")
    tok = _tokenizer()
    vocab, pad_id = _vocab_size(tok), int(tok.pad_token_id)
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(_config(vocab, pad_id, target_layers, hidden, heads, kv_heads)).eval()
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:  # residual passes through unchanged
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft = Qwen2ForCausalLM(_config(vocab, pad_id, draft_layers, hidden, heads, kv_heads)).eval()
    missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    assert not [k for k in missing if "rotary" not in k], missing
    assert all(k.startswith("model.layers.") and int(k.split(".")[2]) >= draft_layers for k in unexpected), unexpected
    if alpha_noise > 0:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in draft.parameters():
                if p.is_floating_point() and p.numel() > 1:
                    p.add_(torch.randn(p.shape, generator=g) * alpha_noise * (p.std() + 1e-6))
    for m in (target, draft):
        m.generation_config.pad_token_id = pad_id
        m.generation_config.eos_token_id = None  # fixed-length decoding
        m.generation_config.bos_token_id = None
    return target, draft, tok


def describe(alpha_noise: float, target_layers: int = TARGET_LAYERS, draft_layers: int = DRAFT_LAYERS) -> str:
    return (f"overhead: random Qwen2 {target_layers}-layer target (layers {draft_layers}..{target_layers - 1} add "
            f"nothing) + its first {draft_layers} layers as draft, hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} KV "
            f"heads, byte vocab, alpha_noise={alpha_noise:g} (0: draft = target, α = 1), no EOS")
