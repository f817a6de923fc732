"""Logits processors applied exactly as plain generate() would, at every position of a speculative block.

Plain decoding calls `processors(input_ids, scores)` once per token with that token's own prefix. A verify
forward yields K+1 positions at once; each must see its own prefix (committed tokens + drafts before it), so
input-dependent processors (repetition penalty, no-repeat-ngram, min-new-tokens, bad words) stay exact.

Which processors are exact: every processor whose output is a pure function of (input_ids, scores), because SSD
calls it more often than plain decoding and in another order: once per position of every verified block, on
prefixes that end in drafts the target may reject, and possibly again for the same prefix. That covers all of
transformers' own processors in `transformers.generation.logits_process` that SSD accepts (temperature, top-k/p,
min-p, typical, epsilon/eta, repetition and presence penalties, no-repeat-ngram, bad words, min length /
min new tokens, forced BOS/EOS, suppress tokens, sequence bias, exponential decay length penalty, the watermarks
and `prefix_allowed_tokens_fn` when that function is pure). Classifier-free guidance keeps state and is refused.
A custom processor that keeps state across calls (counts calls, caches the last prefix, draws random numbers)
would change the output silently: SSD warns once per such class (RuntimeWarning) unless `ssd_trust_processors=True`
says they are all pure.
"""
from __future__ import annotations

import copy
import warnings
from collections import defaultdict

import torch
from transformers.generation.logits_process import (
    ClassifierFreeGuidanceLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

# Processors whose output depends only on the scores, never on input_ids: safe to batch over positions.
INPUT_INDEPENDENT = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)
# Processors that carry state across calls or run a second model: they cannot be replayed per position.
STATEFUL = (ClassifierFreeGuidanceLogitsProcessor, UnbatchedClassifierFreeGuidanceLogitsProcessor)


BUILTIN_MODULE = "transformers.generation.logits_process"
_WARNED: set = set()  # custom processor classes (or plain callables) already warned about in this process


def check_processors(processors: LogitsProcessorList, trust: bool = False) -> None:
    for proc in processors:
        if isinstance(proc, STATEFUL):
            raise ValueError(
                f"{type(proc).__name__} (guidance_scale / classifier-free guidance) keeps state across steps and "
                "cannot be verified speculatively; drop guidance_scale or generate without ssd=True."
            )
        if trust or type(proc).__module__ == BUILTIN_MODULE:
            continue
        key = type(proc) if isinstance(proc, LogitsProcessor) or not hasattr(proc, "__qualname__") else proc
        if key in _WARNED:
            continue
        _WARNED.add(key)
        name = getattr(key, "__qualname__", type(proc).__qualname__)
        warnings.warn(
            f"hf_ssd: the custom logits processor {name} is called once per position of every speculative block "
            "(also on prefixes ending in drafts that get rejected), so ssd=True reproduces plain generate() only "
            "if it is a pure function of (input_ids, scores) without state kept across calls. If it is, pass "
            "ssd_trust_processors=True to silence this warning; if not, generate without ssd=True.",
            RuntimeWarning,
            stacklevel=3,
        )


def with_temperature(processors: LogitsProcessorList, temperature: float | None) -> LogitsProcessorList:
    """The draft's processors: the target's, with the temperature replaced (or added) when one is given."""
    if temperature is None:
        return processors
    out = LogitsProcessorList([p for p in processors if not isinstance(p, TemperatureLogitsWarper)])
    if temperature != 1.0:
        out.insert(0, TemperatureLogitsWarper(temperature))
    return out


def group_by_length(rows: list[torch.Tensor]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[row.shape[-1]].append(i)
    return groups


def for_rows(processors: LogitsProcessorList, rows: torch.Tensor | None) -> LogitsProcessorList:
    """The processors restricted to batch rows `rows` (original indices): per-row state such as the repetition
    penalty's `prompt_ignore_length` (the left padding of each prompt row) is sliced to those rows, and
    `prefix_allowed_tokens_fn` is called with each row's original batch index."""
    if rows is None:
        return processors
    out = LogitsProcessorList()
    for proc in processors:
        ignore = getattr(proc, "prompt_ignore_length", None)
        if isinstance(ignore, torch.Tensor):
            proc = copy.copy(proc)
            proc.prompt_ignore_length = ignore[rows.to(ignore.device)]
        if isinstance(proc, PrefixConstrainedLogitsProcessor):
            proc = copy.copy(proc)
            fn, index = proc._prefix_allowed_tokens_fn, rows.tolist()
            proc._prefix_allowed_tokens_fn = lambda batch_id, sent, fn=fn, index=index: fn(index[batch_id], sent)
        out.append(proc)
    return out


def process_block(
    processors: LogitsProcessorList,
    prefixes: list[torch.Tensor],
    block: torch.Tensor,
    logits: torch.Tensor,
    row_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Processed scores for a block of positions.

    prefixes: per row, the 1D token ids before the block (the prompt row as given, plus generated tokens).
    block:    [B, n] tokens appended after the prefix; position i's scores follow prefix + block[:, :i].
    logits:   [B, n + 1, V] raw logits; position i predicts the token after prefix + block[:, :i].
    row_ids:  [B] each row's index in the original batch (for processors that keep per-row state).
    """
    if len(processors) == 0:
        return logits
    B, P, V = logits.shape
    if all(isinstance(p, INPUT_INDEPENDENT) for p in processors):
        dummy = torch.zeros(B * P, 1, dtype=torch.long, device=logits.device)
        return processors(dummy, logits.reshape(B * P, V)).reshape(B, P, V)
    out = torch.empty_like(logits)
    # Rows are grouped by prefix length so length-dependent processors (min_new_tokens) see true lengths.
    for _, rows in group_by_length(prefixes).items():
        base = torch.stack([prefixes[r] for r in rows]).to(logits.device)
        idx = torch.tensor(rows, device=logits.device)
        group = for_rows(processors, None if row_ids is None else row_ids[idx.cpu()])
        for i in range(P):
            ids = torch.cat([base, block[idx, :i]], dim=1)
            out[idx, i] = group(ids, logits[idx, i].clone())
    return out
