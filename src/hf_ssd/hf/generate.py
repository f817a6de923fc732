"""`model.generate(..., assistant_model=draft, ssd=True)`: the wrapper around transformers' generate().

transformers prepares everything exactly as for plain decoding (generation config, logits processors, stopping
criteria, lengths, attention mask) and then calls a `custom_generate` callable; ours runs the SSD engine. Things
transformers drops for custom callables (assistant_model, streamer, tokenizer) are taken out here and handed
to the engine directly. Without `ssd=True` the original generate() runs untouched.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_ssd.config import SSDConfig, config_from_kwargs
from hf_ssd.control.compiled import record_plain_loop_compile
from hf_ssd.control.memory import foresee_plain_tail, record_plain, record_prefill
from hf_ssd.control.plain_acceptance import answer_mask
from hf_ssd.hf.plain_hand_off import DecodeClock, compiled_graphs, use_static_cache
from hf_ssd.kernels.packed_linear import applied as packed_linear_applied
from hf_ssd.kernels.packed_linear import weights_for as packed_linear_weights
from hf_ssd.workers import pool
from hf_ssd.workers.process import DraftProcess
from hf_ssd.session import run_session
from hf_ssd.hf.validate import check_generation, check_pair

_ORIGINAL_GENERATE = GenerationMixin.generate
_last_stats: dict[str, Any] | None = None


@dataclass
class SSDGenerateOutput(GenerateDecoderOnlyOutput):
    """generate()'s usual output plus `ssd_stats` (see `hf_ssd.runtime.stats.SSDStats.summary`)."""

    ssd_stats: dict[str, Any] | None = None


def last_stats() -> dict[str, Any] | None:
    """Stats of the most recent ssd=True generation in this process (also when return_dict_in_generate=False)."""
    return _last_stats


def _config_from_models(*models) -> SSDConfig | None:
    """An SSD config published with a model, draft first: the `ssd_config` key of its generation_config.json, or
    an ssd_config.json file in the directory it was loaded from. Old versions are migrated (hub.upgrade)."""
    from pathlib import Path

    from hf_ssd.config import CONFIG_NAME
    from hf_ssd.hf.hub import config_from_dict

    for model in models:
        if model is None:
            continue
        stored = getattr(getattr(model, "generation_config", None), "ssd_config", None)
        if isinstance(stored, SSDConfig):
            return stored
        name = type(model).__name__
        if stored is not None:
            return config_from_dict(stored, source=f"{name}.generation_config.ssd_config")
        path = Path(str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "_"))
        if (path / CONFIG_NAME).is_file():
            from hf_ssd.hf.hub import _read_json

            return config_from_dict(_read_json(path / CONFIG_NAME), source=str(path / CONFIG_NAME))
    return None


def generate(
    self,
    inputs: torch.Tensor | None = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    prefix_allowed_tokens_fn=None,
    synced_gpus=None,
    assistant_model=None,
    streamer=None,
    negative_prompt_ids=None,
    negative_prompt_attention_mask=None,
    custom_generate=None,
    **kwargs,
):
    ssd = kwargs.pop("ssd", None)
    ssd_config = kwargs.pop("ssd_config", None)
    ssd_keys = [k for k in kwargs if k.startswith("ssd_")]
    shared = dict(inputs=inputs, generation_config=generation_config, logits_processor=logits_processor,
                  stopping_criteria=stopping_criteria, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                  synced_gpus=synced_gpus, negative_prompt_ids=negative_prompt_ids,
                  negative_prompt_attention_mask=negative_prompt_attention_mask)
    if not ssd:
        # A custom_generate repo (e.g. ours, written by custom_generate_repo) takes its own ssd_* options.
        if (ssd_keys or ssd_config is not None) and not isinstance(custom_generate, str):
            raise TypeError(f"SSD options {ssd_keys or ['ssd_config']} were given without ssd=True; add ssd=True.")
        if ssd_config is not None:
            kwargs["ssd_config"] = ssd_config
        return _ORIGINAL_GENERATE(self, **shared, assistant_model=assistant_model, streamer=streamer,
                                  custom_generate=custom_generate, **kwargs)
    if custom_generate is not None:
        raise ValueError("ssd=True already sets the decoding loop; drop custom_generate.")
    if assistant_model is not None and not (isinstance(assistant_model, torch.nn.Module)
                                            and hasattr(assistant_model, "config")):
        raise TypeError(
            f"assistant_model must be a transformers model (a causal LM such as AutoModelForCausalLM.from_pretrained"
            f"(...)) that shares the target's tokenizer, got {type(assistant_model).__name__} {assistant_model!r:.60}"
        )
    base = ssd_config if ssd_config is not None else _config_from_models(assistant_model, self)
    worker_handle = kwargs.get("ssd_worker")
    if isinstance(worker_handle, DraftProcess):  # a kept-alive draft process (see hf_ssd.workers.process)
        if worker_handle.closed:
            raise ValueError("ssd_worker is a DraftProcess that was closed; create a new one "
                             "(hf_ssd.DraftProcess(draft)) or pass ssd_worker=\"process\" for a per-call process.")
        if worker_handle.model is not assistant_model:
            raise ValueError("ssd_worker is a DraftProcess for a different draft model; pass the same assistant_model.")
        kwargs["ssd_worker"] = "process"
    else:
        worker_handle = None
    config = config_from_kwargs(base, kwargs)
    generator = kwargs.pop("generator", None)
    tokenizer = kwargs.pop("tokenizer", None)
    draft_tokenizer = kwargs.pop("assistant_tokenizer", None)
    check_pair(self, assistant_model, (tokenizer, draft_tokenizer))

    # transformers does not hand the tokenizer to custom loops, so stop strings are built here.
    stop_strings = kwargs.pop("stop_strings", None)
    if stop_strings is None and generation_config is not None:
        stop_strings = generation_config.stop_strings
        if stop_strings is not None:
            shared["generation_config"] = generation_config.__class__.from_dict(
                {**generation_config.to_dict(), "stop_strings": None})
    shared["stopping_criteria"] = StoppingCriteriaList(stopping_criteria or [])
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate().")
        shared["stopping_criteria"].append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))

    ids = inputs if inputs is not None else kwargs.get("input_ids")
    _check_mask(ids, kwargs.get("attention_mask"))
    batch_size = ids.shape[0] if ids is not None and ids.dim() == 2 else 1
    decode = functools.partial(_ssd_decode, draft=assistant_model, config=config, streamer=streamer,
                               generator=generator, worker=worker_handle)
    return _ORIGINAL_GENERATE(self, **shared, custom_generate=_with_checks(decode, dict(kwargs), batch_size, streamer),
                              **kwargs)


def _check_mask(input_ids, mask) -> None:
    if isinstance(input_ids, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape "
                         f"{tuple(input_ids.shape)}; pass one mask entry per input token (as the tokenizer returns).")


def _with_checks(decode, kwargs, batch_size, streamer):
    def ssd_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                     **model_kwargs):
        check_generation(generation_config, kwargs, batch_size, streamer)
        return decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)

    return ssd_decoding


def _ssd_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, *, draft, config, streamer,
                generator, worker, **model_kwargs):
    global _last_stats
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    else:
        _check_mask(input_ids, mask)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    handed_off = False
    rng = _rng_state(input_ids.device)  # measuring and seeding the draft side draw from it: plain must not notice
    try:
        rows, stats = run_session(
            model, draft, input_ids, mask, logits_processor, stopping_criteria, generation_config, config, generator,
            streamer, worker, plain_hand_off=generator is None,
        )
        if rows is None:  # the controller chose plain decoding: transformers' own loop (it ends the streamer)
            handed_off = True
            _set_rng_state(input_ids.device, rng)  # the same seed gives plain generate()'s very samples
            compiled_loop = False
            if config.compile_target and not stats.eager_call:  # a compiled target: transformers' compiled path
                why_not = use_static_cache(model, generation_config, model_kwargs)
                compiled_loop = why_not is None
                stats.controller["reason"] += (" (static cache, compiled)" if why_not is None
                                               else f" (eager: a compiled plain loop could not be set up: {why_not})")
            # the eager loop's one-token steps through the packed kernel, as our engine's forwards (the controller
            # prices plain at our packed one-token step)
            packed = None if compiled_loop else packed_linear_weights(model, config.packed_linear)
            start, graphs, clock, busy = time.perf_counter(), compiled_graphs(), DecodeClock(), pool.starting()
            probe = stats.plain_probe
            watching = probe.processors() if probe is not None else []  # last: they see the final scores
            processors = LogitsProcessorList([*logits_processor, clock, *watching])
            with packed_linear_applied(packed):
                result = GenerationMixin._sample(model, input_ids, processors,
                                                 stopping_criteria, generation_config, synced_gpus=False,
                                                 streamer=streamer, **model_kwargs)
            end = time.perf_counter()
            stats.wall_time = end - start
            sequences = result if isinstance(result, torch.Tensor) else result.sequences
            compiled = compiled_graphs() != graphs  # transformers compiled its loop: its steps that did are left out
            step_s = clock.seconds_per_step(end, sequences.shape[1] - input_ids.shape[1], compiled)
            # a run that shared the CPU with a draft process's start-up would price plain by that
            if step_s is not None and not (busy or pool.starting()):
                answer = sequences[:, input_ids.shape[1]:]
                made = float(answer_mask(answer, _eos_ids(generation_config)).float().mean())
                record_plain(stats.controller_memory, step_s, answer.shape[1] - 1, rows_share=made)
            quiet = not (compiled or busy or pool.starting())  # its prefill was the call's alone
            if stats.controller_memory is not None and clock.first is not None and quiet:
                record_prefill(stats.controller_memory, "plain", clock.first - start, input_ids.shape[1] - 1)
            if compiled and clock.first is not None:  # what compiling took: the slow steps, else the whole loop
                record_plain_loop_compile(model, clock.compile_s if step_s is not None else end - clock.first)
            if probe is not None:
                stats.controller["plain_alpha"] = _measure_plain_alpha(probe, sequences, input_ids, mask,
                                                                       generation_config)
    finally:
        if streamer is not None and not handed_off:
            streamer.end()
    if not handed_off:
        out = _padded_output(rows.tokens, input_ids, generation_config)
        probe = stats.plain_probe  # plain in our loop from the start (greedy): α along its answer, if it stayed plain
        if probe is not None and stats.controller is not None and not stats.controller["switches"]:
            stats.controller["plain_alpha"] = _measure_plain_alpha(probe, out, input_ids, mask, generation_config)
    if stats.controller_memory is not None and not handed_off and stats.target_prefill_s is not None:
        # per padded column, as plain's: our loop ran only `prefill_share` of them, a share that varies with the
        # batch's padding (a batch of one long and three short prompts 0.44, of similar ones 0.85)
        record_prefill(stats.controller_memory, "engine", stats.target_prefill_s,
                       (input_ids.shape[1] - 1) * stats.prefill_share)
        foresee_plain_tail(stats.controller_memory, [len(t) for t in rows.tokens])
    if stats.controller_memory is not None:  # how long calls run here: the next calls' horizon
        made = sequences.shape[1] - input_ids.shape[1] if handed_off else max(len(t) for t in rows.tokens)
        stats.controller_memory.call_length.add(made, ended=made < generation_config.max_length - input_ids.shape[1])
        stats.controller_memory.end_call()
    summary = stats.summary()
    _last_stats = summary
    if handed_off:
        if not generation_config.return_dict_in_generate:
            return result
        return SSDGenerateOutput(**{k: v for k, v in result.items()}, ssd_stats=summary)
    longest = max(len(t) for t in rows.tokens)
    if not generation_config.return_dict_in_generate:
        return out

    def steps(per_row):
        if not any(per_row):
            return None
        V = next(x for r in per_row for x in r).shape[-1]
        return tuple(
            torch.stack([r[t] if t < len(r) else torch.full((V,), float("-inf")) for r in per_row]).to(out.device)
            for t in range(longest)
        )

    return SSDGenerateOutput(
        sequences=out,
        scores=steps(rows.scores) if generation_config.output_scores else None,
        logits=steps(rows.logits) if generation_config.output_logits else None,
        ssd_stats=summary,
    )


def _padded_output(tokens: list[list[int]], input_ids: torch.Tensor, generation_config) -> torch.Tensor:
    """Prompts and each row's generated `tokens`, right-padded with the pad token to the longest row (as
    transformers' generate() returns a batch)."""
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else 0
    B, P = input_ids.shape
    out = torch.full((B, P + max(len(t) for t in tokens)), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :P] = input_ids
    for b, toks in enumerate(tokens):
        if toks:
            out[b, P:P + len(toks)] = torch.tensor(toks, device=input_ids.device)
    return out


def _measure_plain_alpha(probe, sequences, input_ids, mask, generation_config) -> dict:
    """α along the answer plain decoding just made, for the controller's next calls (control.plain_acceptance). It
    only reads the finished output: a failure is noted in ssd_stats and changes nothing else."""
    try:
        return (probe.finish(sequences, input_ids.shape[1], mask, _eos_ids(generation_config))
                or {"skipped": "no answer tokens"})
    except Exception as exc:  # noqa: BLE001 - measuring is optional; the answer is already made
        return {"failed": f"{type(exc).__name__}: {exc}"}


def _eos_ids(generation_config) -> list[int]:
    eos = generation_config._eos_token_tensor
    return [] if eos is None else [int(t) for t in eos.reshape(-1)]


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def enable(model=None) -> None:
    """Enable `generate(..., ssd=True)` for every model (default), or for one model instance only."""
    if model is None:
        GenerationMixin.generate = generate
    else:
        model.generate = functools.partial(generate, model)


def disable() -> None:
    """Restore transformers' own generate() for all models."""
    GenerationMixin.generate = _ORIGINAL_GENERATE


def is_enabled() -> bool:
    return GenerationMixin.generate is generate
