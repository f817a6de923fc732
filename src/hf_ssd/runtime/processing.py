"""Logits processors applied exactly as plain generate() would, at every position of a speculative block.

Plain decoding calls `processors(input_ids, scores)` once per token with that token's own prefix. A verify
forward yields K+1 positions at once; each must see its own prefix (committed tokens + drafts before it), so
input-dependent processors (repetition penalty, no-repeat-ngram, min-new-tokens, bad words) stay exact.
"""
from __future__ import annotations

import copy
from collections import defaultdict

import torch
from transformers.generation.logits_process import (
    ClassifierFreeGuidanceLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
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


def check_processors(processors: LogitsProcessorList) -> None:
    for proc in processors:
        if isinstance(proc, STATEFUL):
            raise ValueError(
                f"{type(proc).__name__} (guidance_scale / classifier-free guidance) keeps state across steps and "
                "cannot be verified speculatively; drop guidance_scale or generate without ssd=True."
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
