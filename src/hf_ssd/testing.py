"""What the tests, the examples and the bench share, each helper once: tiny random models built from configs (no
download), toy tokenizers, left padding, and element-wise references of the vectorised math.

Imports only torch, transformers and tokenizers (no pytest), so examples and `hf-ssd bench --tiny` can use it.

Every model is float32 with a large `initializer_range`, so logits have clear gaps and greedy argmaxes are not
decided by rounding. `get_pair(arch)` gives a target with three drafts: `related` (the target with small noise on
its weights: acceptance high but not 1), `same` (the target itself: acceptance 1, every cache lookup can hit) and
`shallow` (the target's first layer only: a draft of a different depth, low acceptance).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
import transformers

from hf_ssd.core.padding import left_pad
from hf_ssd.core.types import Forks

__all__ = [
    "ARCHS", "BUILDERS", "COMMON", "EOS", "PAD", "VOCAB", "Pair", "build_target", "byte_tokenizer", "char_tokenizer",
    "gen_tokens", "get_pair", "left_pad", "noisy_copy", "plain_generate", "prompt", "shallow_copy", "ssd_generate",
    "tiny_llama", "tiny_pair", "tiny_requested", "tree_attend_reference", "word_tokenizer",
]

VOCAB = 96
EOS = VOCAB - 1  # a token the tiny models never reach for in most tests; tests that want EOS pick their own
PAD = 0

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


# ---- models ------------------------------------------------------------------------------------------------------
def tiny_llama(seed: int | None = None, **config) -> transformers.LlamaForCausalLM:
    """A random Llama from `COMMON` with `config` overriding it, in eval mode (seeded first unless seed is None)."""
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, **config})).eval()


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
    "llama": tiny_llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "mistral": _mistral,
    "gpt2": _gpt2,
    "neox": _neox,
}
ARCHS = list(BUILDERS)


def build_target(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = BUILDERS[arch]().eval()
    model.generation_config.pad_token_id = PAD
    return model


def noisy_copy(model, scale: float = 0.02, seed: int = 1, relative: bool = True):
    """The model with Gaussian noise on every float parameter: `scale` times each weight's spread (relative), or
    `scale` itself (relative=False)."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * scale * ((p.std() + 1e-6) if relative else 1.0))
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


@dataclass
class Pair:
    arch: str
    target: torch.nn.Module
    related: torch.nn.Module  # noisy copy: acceptance high but < 1
    same: torch.nn.Module  # the target itself: acceptance 1
    shallow: torch.nn.Module  # the target's first layer only: a draft of different depth


_PAIRS: dict[str, Pair] = {}


def get_pair(arch: str) -> Pair:
    """The target of `arch` and its three drafts, built once per process."""
    if arch not in _PAIRS:
        target = build_target(arch)
        _PAIRS[arch] = Pair(arch, target, noisy_copy(target, 0.05), target, shallow_copy(target))
    return _PAIRS[arch]


def tiny_pair(seed: int = 0, noise: float = 0.02, layers: int = 2, hidden: int = 64):
    """(target, draft, tokenizer) for CI and `--tiny`: random Llama models over `byte_tokenizer()`, fp32, eval mode.
    The draft is the target with small noise, so it agrees most of the time while still being a different model.
    Outputs are gibberish; only the mechanics count."""
    tok = byte_tokenizer()
    target = tiny_llama(
        seed, vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    draft = noisy_copy(target, noise, seed=seed + 1, relative=False)
    for m in (target, draft):
        m.generation_config.pad_token_id = tok.pad_token_id
        m.generation_config.eos_token_id = tok.eos_token_id
        m.generation_config.bos_token_id = tok.bos_token_id
    return target, draft, tok


def worker_pair(shape: tuple[int, int], seed: int, padded: dict[int, int]):
    """The worker tests' pair: a tiny Llama (EOS 2, no pad token) with its one-layer shallow copy as the draft,
    and random prompts of `shape`, left-padded by `padded` (row -> padding tokens). Returns (target, draft,
    prompts, mask)."""
    target = tiny_llama(0, hidden_size=48, intermediate_size=96, initializer_range=0.4, eos_token_id=2,
                        pad_token_id=None)
    prompts = torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(prompts)
    for row, pads in padded.items():
        mask[row, :pads] = 0
    return target, shallow_copy(target), prompts, mask


def tiny_requested(flag: bool = False) -> bool:
    """True when `--tiny` was given or the environment variable HF_SSD_TINY is set to a non-empty, non-0 value."""
    return flag or os.environ.get("HF_SSD_TINY", "") not in ("", "0")


# ---- inputs and generation ---------------------------------------------------------------------------------------
def prompt(length: int, seed: int = 0, low: int = 2, high: int = VOCAB - 1) -> torch.Tensor:
    """[1, length] random token ids in [low, high)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (1, length), generator=g)


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
    # A fixed SSD plan (what these tests exercise), not the controller's choice: exactness must not depend on it.
    kw.setdefault("ssd_mode", "ssd")
    kw.setdefault("ssd_num_draft_tokens", 4)
    kw.setdefault("ssd_budget", 6)
    kw.setdefault("ssd_draft_quantize", None)
    with torch.no_grad():
        return model.generate(ids, assistant_model=draft, ssd=True, **kw)


def gen_tokens(out: torch.Tensor, prompt_len: int) -> list[list[int]]:
    return [row[prompt_len:].tolist() for row in out]


class InterruptOnCall:
    """A stopping criterion that raises KeyboardInterrupt on its n-th call (a user's Ctrl-C mid-generation)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


# ---- toy tokenizers ----------------------------------------------------------------------------------------------
def word_tokenizer(size: int = VOCAB, shift: int = 0) -> transformers.PreTrainedTokenizerFast:
    """Word level: id i is the word f"w{i + shift}" (words split on whitespace, decoded joined by spaces); pad = id 0,
    bos = id 1, unk = id 2, eos = id size-1. Different `shift`s give same-sized tokenizers with different
    vocabularies."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    word = [f"w{i + shift}" for i in range(size)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(word)}, unk_token=word[2]))
    tok.pre_tokenizer = Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=word[0], eos_token=word[-1],
                                                bos_token=word[1], unk_token=word[2])


def char_tokenizer(size: int = VOCAB) -> transformers.PreTrainedTokenizerFast:
    """One character per token (ids 0..size-1 = chr(32)..): can encode any ASCII text, as stop strings need."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(vocab={chr(32 + i): i for i in range(size)}, merges=[]))
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """GPT-2 style byte level with no merges: 256 byte tokens + <s>, </s>, <pad> (ids 256, 257, 258); pads left."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for name in ("<s>", "</s>", "<pad>"):
        vocab[name] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", padding_side="left")


# ---- element-wise references of the vectorised math --------------------------------------------------------------
def tree_attend_reference(past_valid, glue_valid, forks: Forks, step: int) -> torch.Tensor:
    """`hf_ssd.core.tree.tree_attend`, element by element: branch i of row b sees the valid committed prefix, the
    valid glue slots up to its depth, and its own slot in each of the `step` tree steps so far."""
    B, N = forks.tokens.shape
    L0, P = past_valid.shape[1], glue_valid.shape[1]
    out = torch.zeros(B, N, L0 + P + step * N, dtype=torch.bool)
    for b in range(B):
        for i in range(N):
            for s in range(L0):
                out[b, i, s] = bool(past_valid[b, s])
            for m in range(P):
                out[b, i, L0 + m] = bool(glue_valid[b, m]) and m <= int(forks.depth[b, i])
            for st in range(step):
                out[b, i, L0 + P + st * N + i] = bool(forks.valid[b, i])
    return out
