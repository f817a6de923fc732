"""Refuse what SSD cannot do exactly, with an error that says what to change."""
from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from hf_ssd.runtime.kv import attention_layout


def check_pair(target: PreTrainedModel, draft: PreTrainedModel | None, tokenizers: tuple[Any, Any]) -> None:
    if draft is None:
        raise ValueError(
            "ssd=True needs a draft model: call generate(..., assistant_model=draft_model, ssd=True) with a small "
            "causal LM that shares the target's tokenizer."
        )
    for role, model in (("target", target), ("draft (assistant_model)", draft)):
        if model.config.is_encoder_decoder:
            raise ValueError(f"the {role} is an encoder-decoder model; ssd=True supports decoder-only causal LMs.")
        if getattr(model, "_is_stateful", False):
            raise ValueError(
                f"the {role} ({type(model).__name__}) is stateful (recurrent state cannot be rolled back after a "
                "rejected draft); use an attention-only model or generate without ssd=True."
            )
        attention_layout(model)  # raises on layer types we cannot roll back
    tok, draft_tok = tokenizers
    if tok is not None and draft_tok is not None:
        if tok.get_vocab() != draft_tok.get_vocab():
            raise ValueError(
                "the target and draft tokenizers have different vocabularies; ssd=True needs a draft that shares the "
                "target's tokenizer (e.g. a smaller model of the same family)."
            )
        return
    v_t = target.config.get_text_config().vocab_size
    v_d = draft.config.get_text_config().vocab_size
    if v_t != v_d:
        raise ValueError(
            f"the target's vocabulary has {v_t} tokens but the draft's has {v_d}; ssd=True needs a draft that shares "
            "the target's tokenizer. If they share it and only the embedding padding differs, pass both tokenizers "
            "(tokenizer=..., assistant_tokenizer=...) so hf_ssd can check the vocabularies are identical."
        )
    for name in ("bos_token_id", "eos_token_id"):
        a, b = getattr(target.config, name, None), getattr(draft.config, name, None)
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"target {name}={a} but draft {name}={b}: the two models do not share a tokenizer; pick a draft from "
                "the target's model family, or pass tokenizer= and assistant_tokenizer= if they do share one."
            )


def check_draft_device(name: str) -> torch.device:
    """The device `ssd_draft_device` names, refused (before anything moves) if this machine cannot hold the draft."""
    device = torch.device(name)
    if device.type == "meta":
        raise ValueError(f"ssd_draft_device={name!r} is invalid: 'meta' holds no weights; use a real device")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"ssd_draft_device={name!r} is invalid: CUDA is not available on this machine; use "
                             "'cpu' or leave ssd_draft_device unset")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"ssd_draft_device={name!r} is invalid: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
    elif device.type not in ("cpu",):
        backend = getattr(torch, device.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"ssd_draft_device={name!r} is invalid: {device.type} is not available here")
    return device


def check_generation(config: GenerationConfig, kwargs: dict[str, Any], batch_size: int, streamer: Any) -> None:
    if config.num_beams is not None and config.num_beams > 1:
        raise ValueError(f"num_beams={config.num_beams} cannot be combined with ssd=True; use num_beams=1.")
    if config.num_return_sequences is not None and config.num_return_sequences > 1:
        raise ValueError(
            f"num_return_sequences={config.num_return_sequences} is not supported with ssd=True; repeat the prompt "
            "in the batch instead (input_ids.repeat(n, 1)), which SSD runs as one batch."
        )
    if config.guidance_scale is not None and config.guidance_scale != 1.0:
        raise ValueError(
            "guidance_scale (classifier-free guidance) keeps state across steps and cannot be verified "
            "speculatively; drop guidance_scale or generate without ssd=True."
        )
    if config.penalty_alpha is not None and config.penalty_alpha != 0:
        raise ValueError(
            f"penalty_alpha={config.penalty_alpha} (contrastive search) cannot be combined with ssd=True: contrastive "
            "search re-ranks candidates with the model's hidden states, which speculative verification does not "
            "reproduce; drop penalty_alpha or generate without ssd=True."
        )
    if getattr(config, "dola_layers", None) is not None:
        raise ValueError(
            f"dola_layers={config.dola_layers!r} (DoLa decoding) cannot be combined with ssd=True: it contrasts early "
            "layers' logits, which speculative verification does not reproduce; drop dola_layers or generate "
            "without ssd=True."
        )
    cache_impl = config.cache_implementation
    if cache_impl not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={cache_impl!r} is not supported with ssd=True (its cache cannot hold the holes "
            "left by rejected drafts); leave cache_implementation unset (dynamic cache)."
        )
    past = kwargs.get("past_key_values")
    if past is not None:
        raise ValueError(
            f"past_key_values ({type(past).__name__}) cannot be passed with ssd=True: SSD builds and rolls back its "
            "own caches for target and draft; drop past_key_values."
        )
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds is not supported with ssd=True; pass input_ids.")
    if streamer is not None and batch_size > 1:
        raise ValueError("streamers take one sequence; with ssd=True stream a batch of 1 (or drop streamer=).")
