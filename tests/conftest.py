"""Tiny random models built from configs (no downloads), shared by the exactness and input tests.

Every model is float32 with a large `initializer_range`, so logits have clear gaps and greedy argmaxes are not
decided by rounding. Each target comes with three drafts: `related` (the target with small noise on its weights:
acceptance is high but not 1), `same` (the target itself: acceptance 1, every cache lookup can hit) and `shallow`
(the target's first layer only: a draft of a different depth, low acceptance).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import transformers

import hf_ssd  # noqa: F401  (enables generate(..., ssd=True))

VOCAB = 96
EOS = VOCAB - 1  # a token the tiny models never reach for in most tests; tests that want EOS pick their own
PAD = 0

torch.set_num_threads(1)  # tiny models: one intra-op thread is fastest and keeps timings stable on 2 shared cores

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=EOS,
    pad_token_id=PAD,
    tie_word_embeddings=False,
)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=8))


def _gemma3():
    cfg = transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 2},
        head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    )
    return transformers.Gemma3ForCausalLM(cfg)


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=4))


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, initializer_range=0.3,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _neox():
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, initializer_range=0.3, rotary_pct=0.25, bos_token_id=1, eos_token_id=EOS,
        pad_token_id=PAD, tie_word_embeddings=False,
    )
    return transformers.GPTNeoXForCausalLM(cfg)


BUILDERS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "mistral": _mistral,
    "gpt2": _gpt2,
    "neox": _neox,
}
ARCHS = list(BUILDERS)


def noisy_copy(model, scale: float = 0.02, seed: int = 1):
    """The model with small Gaussian noise (relative to each weight's spread) on every float parameter."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() + 1e-6))
    return draft.eval()


def shallow_copy(model, layers: int = 1):
    """A draft with the target's first `layers` layers (and its embeddings, norm and head): a different depth, so
    the draft cache has fewer layers than the target's (for Gemma3: only the sliding-window layer)."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[:layers]
    draft = type(model)(cfg)
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    assert not [k for k in missing if "rotary" not in k], missing
    return draft.eval()


def build_target(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = BUILDERS[arch]().eval()
    model.generation_config.pad_token_id = PAD
    return model


@dataclass
class Pair:
    arch: str
    target: torch.nn.Module
    related: torch.nn.Module  # noisy copy: acceptance high but < 1
    same: torch.nn.Module  # the target itself: acceptance 1
    shallow: torch.nn.Module  # the target's first layer only: a draft of different depth


_CACHE: dict[str, Pair] = {}


def get_pair(arch: str) -> Pair:
    if arch not in _CACHE:
        target = build_target(arch)
        _CACHE[arch] = Pair(arch, target, noisy_copy(target, 0.05), target, shallow_copy(target))
    return _CACHE[arch]


@pytest.fixture(params=ARCHS)
def pair(request) -> Pair:
    return get_pair(request.param)


@pytest.fixture
def llama() -> Pair:
    return get_pair("llama")


def prompt(length: int, seed: int = 0, low: int = 2, high: int = VOCAB - 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (1, length), generator=g)


def left_pad(rows: list[torch.Tensor], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1D rows into (input_ids, attention_mask)."""
    L = max(r.numel() for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - r.numel():] = r
        mask[i, L - r.numel():] = 1
    return ids, mask


def plain_generate(model, ids, **kw) -> torch.Tensor:
    """Stock transformers generate() (hf_ssd's wrapper passes through without ssd=True, but call the original)."""
    from hf_ssd.hf.generate import _ORIGINAL_GENERATE

    kw.setdefault("do_sample", False)
    kw.setdefault("pad_token_id", PAD)
    with torch.no_grad():
        return _ORIGINAL_GENERATE(model, ids, **kw)


def ssd_generate(model, draft, ids, **kw):
    kw.setdefault("do_sample", False)
    kw.setdefault("pad_token_id", PAD)
    kw.setdefault("ssd_budget", 6)
    with torch.no_grad():
        return model.generate(ids, assistant_model=draft, ssd=True, **kw)


def gen_tokens(out: torch.Tensor, prompt_len: int) -> list[list[int]]:
    return [row[prompt_len:].tolist() for row in out]
