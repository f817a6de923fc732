"""α measured on a call that ran plain decoding, so a plain choice can be undone.

Plain decoding drafts nothing, so it observes no acceptance: once the controller's α fell under the break-even
(after a few unlucky rounds, or because calls that switched to plain mid-way left their unlucky rounds in the
pool), every later call ran plain and α never moved again. The default pair at T=0.7 ran plain in 18 of 18 calls
while our synchronous SD ran 1.13-1.25x faster than plain on the same prompts.

After such a call the answer is known, and the draft's acceptance along it can be read off a draft pass over
prompt and answer (a prefill, then the answer in chunks), with no effect on the output:
- greedy: a draft is accepted where the draft's argmax equals the token the target chose;
- sampled: the first draft at a position is accepted with probability sum_x min(p(x), q(x)) (p the target's final
  distribution there, q the draft's), summed here over the target's TOP likeliest tokens (a lower bound; the tail
  beyond them is negligible after temperature or top-k/p).
Each position adds its acceptance probability a to the accepted drafts and 1 - a to the rejections: per token the
same Bernoulli counts the drafting rounds give (control.memory.Memory.alpha).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

from hf_ssd.control.memory import Memory
from hf_ssd.draft.model import DraftModel
from hf_ssd.runtime.kv import CachedModel

TOP = 64  # target probabilities kept per step (sampling)
CHUNK = 16  # answer tokens per draft forward (measure)


class TargetTopProbs(LogitsProcessor):
    """Last in plain decoding's processor list: keeps the TOP largest probabilities (and their tokens) of each step's
    final distribution, the one plain sampling draws from. Changes nothing."""

    def __init__(self):
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids, scores):
        probs = scores.float().softmax(dim=-1)
        top = probs.topk(min(TOP, probs.shape[-1]), dim=-1)
        self.steps.append((top.values, top.indices))
        return scores


@dataclass
class Measured:
    accepted: float  # summed acceptance probabilities over the answer's positions (all rows)
    rejected: float  # summed 1 - acceptance
    positions: int
    seconds: float

    @property
    def alpha(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)


class PlainProbe:
    """Measures α along one plain call's answer for the controller's memory: `processors()` go last in plain
    decoding's processor list, `finish()` runs after it."""

    def __init__(self, draft: DraftModel, memory: Memory, label: str, int8: bool = False):
        """draft: the draft at the precision the measurement is for (`int8`: quantized), as the plan `label` runs it."""
        self.draft, self.memory, self.label, self.int8 = draft, memory, label, int8
        self.target = None if draft.greedy else TargetTopProbs()

    def processors(self) -> list[LogitsProcessor]:
        return [] if self.target is None else [self.target]

    def finish(self, sequences: torch.Tensor, prompt_len: int, prompt_mask: torch.Tensor,
               eos_ids: list[int]) -> dict | None:
        """Measure, add to the memory (a rejection stands for one drafting round), and say what was measured."""
        got = measure(self.draft, sequences, prompt_len, prompt_mask, eos_ids, self.target)
        if got is None:
            return None
        self.memory.add_acceptance(got.accepted, got.rejected, rounds=max(1, round(got.rejected)), int8=self.int8,
                                   rows=sequences.shape[0])
        return {"alpha": round(got.alpha, 3), "positions": got.positions, "seconds": round(got.seconds, 3),
                "draft": self.label}


@torch.no_grad()
def measure(draft: DraftModel, sequences: torch.Tensor, prompt_len: int, prompt_mask: torch.Tensor,
            eos_ids: list[int], target: TargetTopProbs | None) -> Measured | None:
    """The draft's acceptance along the answer plain decoding made (`sequences`: prompt and answer, left-padded
    prompts as given by `prompt_mask`). `target`: the kept target probabilities when sampling, None for greedy.
    None when the answer has no tokens to measure."""
    began = time.perf_counter()
    new = sequences.shape[1] - prompt_len
    if new < 1 or (target is not None and len(target.steps) < new):
        return None
    answer = sequences[:, prompt_len:]
    valid = answer_mask(answer, eos_ids)
    device = draft.kv.device
    fed = torch.cat([prompt_mask.to(device).bool(), valid.to(device)], dim=1)[:, :-1]
    positions = (fed.long().cumsum(dim=-1) - 1).clamp(min=0)
    ids = sequences[:, :-1].to(device)
    # The prompt as drafting prefills it, then the answer in chunks of CHUNK tokens, as drafting feeds a few tokens
    # per forward: an int8 draft quantizes most of its activations with one range per forward, and one forward over
    # prompt and answer accepted 0.35 where the same draft fed narrowly accepted 0.53 (the default pair at T = 0.7,
    # before the down projections were scaled per row).
    draft.kv = CachedModel(draft.kv.model, ids.shape[0])  # a cache of its own: the probe's draft serves one measure
    draft.prefill(ids[:, :prompt_len], fed[:, :prompt_len])
    chunks = [draft.kv.forward(ids[:, start:start + CHUNK], positions[:, start:start + CHUNK],
                               fed[:, start:start + CHUNK])
              for start in range(prompt_len - 1, ids.shape[1], CHUNK)]
    scores = draft.scores(torch.cat(chunks, dim=1))  # [B, new, V]: warped as when drafting
    answer = answer.to(device)
    if target is None:
        accept = (scores.argmax(dim=-1) == answer).float()
    else:
        q = scores.softmax(dim=-1)
        p_top = torch.stack([v for v, _ in target.steps[:new]], dim=1).to(device)  # [B, new, TOP]
        top_ids = torch.stack([i for _, i in target.steps[:new]], dim=1).to(device)
        accept = torch.minimum(p_top, q.gather(-1, top_ids)).sum(dim=-1).clamp(max=1.0)
    valid = valid.to(device)
    accepted = float((accept * valid).sum())
    count = int(valid.sum())
    return Measured(accepted, count - accepted, count, time.perf_counter() - began)


def answer_mask(answer: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 for each row's generated tokens up to and including its first end-of-sequence token, 0 after (padding)."""
    if not eos_ids:
        return torch.ones_like(answer, dtype=torch.bool)
    is_eos = torch.isin(answer, torch.tensor(eos_ids, device=answer.device))
    ended_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    return ~ended_before
