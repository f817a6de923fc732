"""A batch's prompt prefill without the left padding's compute.

A left-padded batch costs its prefill B x (longest prompt) tokens: on the bench's MT-Bench and ShareGPT prompts
(capped at 512 tokens) about twice the real ones at batch 4, 2.3-3.1 times at batch 16. Prefilling rows of similar
length together (`padding_groups`), each group over its own longest prompt, does the real work once more and the
padding hardly at all. Each group runs into a dynamic cache of its own; the cache then takes the groups' KV at the
slots the padded prefill would have written (`adopt_groups`: CachedModel and StaticCachedModel each have one), so
what follows sees the layout it always did: left padding as invalid slots, every row's write pointer past the
prompt. Attention never reads an invalid slot, so only the float rounding of the real tokens' KV can differ from
the padded prefill's (different matrix shapes), as between any two batchings of the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hf_ssd.runtime.kv import CachedModel

# The fixed cost of one more forward, in prompt tokens it is worth: a group is a forward of its own. Measured on the
# project's 2-core CPU (overhead workload's 28-layer target, hidden 64): 11 ms a forward of 1 token, 0.1 ms a prompt
# token, so about 100; a wider model's tokens cost more, so fewer. On a GPU an eager forward is launch-bound (tens of
# ms) while a prompt token of a 1.5B model costs microseconds: an estimate, not measured here.
FORWARD_TOKENS = {"cpu": 64, "cuda": 2048}
GROUPED_AT_MOST = 0.9  # grouping runs where it saves at least a tenth of the padded prefill's cost


@dataclass(frozen=True)
class Group:
    rows: list[int]  # rows of the batch, longest prompt first
    start: int  # the first column any of them needs: the group's forward covers columns start..n-1


def padding_groups(valid: torch.Tensor, forward_tokens: int) -> list[Group] | None:
    """Rows of a [B, n] validity mask in groups whose prefill costs least: sum over groups of rows x width plus
    `forward_tokens` per group, a row's width running from its first valid column. With the distinct widths sorted,
    the best split into runs of them is a small dynamic programme (rows of one width always share a group: a
    batch of 16,000 copies of two prompts is two groups, found at once). None where one padded forward of
    everything is as cheap (within GROUPED_AT_MOST), e.g. no padding. Rows with no valid column are in no group."""
    B, n = valid.shape
    if B < 2:
        return None
    has = valid.any(dim=1)
    widths = torch.where(has, n - valid.int().argmax(dim=1), torch.zeros_like(has, dtype=torch.long))
    distinct, counts = torch.unique(widths[widths > 0], sorted=True, return_counts=True)
    if len(distinct) == 0 or (len(distinct) == 1 and int(counts[0]) == B):
        return None
    w = distinct.flip(0).double().numpy()  # widths, longest first
    rows_before = np.concatenate([[0], np.cumsum(counts.flip(0).double().numpy())])
    # best[i]: least cost of the first i widths; cut[i]: where its last group starts (a group is as wide as its first)
    best, cut = np.zeros(len(w) + 1), np.zeros(len(w) + 1, dtype=np.int64)
    for i in range(1, len(w) + 1):
        costs = best[:i] + (rows_before[i] - rows_before[:i]) * w[:i] + forward_tokens
        cut[i] = int(costs.argmin())
        best[i] = costs[cut[i]]
    if best[-1] > GROUPED_AT_MOST * (B * n + forward_tokens):
        return None
    by_width: dict[int, list[int]] = {}
    for r, width in enumerate(widths.tolist()):
        by_width.setdefault(width, []).append(r)
    groups, i = [], len(w)
    while i > 0:
        j = int(cut[i])
        groups.append(Group([r for width in w[j:i] for r in by_width[int(width)]], n - int(w[j])))
        i = j
    return groups[::-1]


def grouped_share(valid: torch.Tensor, forward_tokens: int) -> float:
    """The prompt tokens our grouped prefill runs, as a share of the padded prefill's B x n (1 where it would not
    group): what the target's prefill costs in our loop against transformers' (the controller prices ours per
    padded column at this share; Controller.target_prefill_s)."""
    groups = padding_groups(valid, forward_tokens)
    if groups is None:
        return 1.0
    B, n = valid.shape
    return sum(len(g.rows) * (n - g.start) for g in groups) / (B * n)


def forward_tokens(device: torch.device) -> int:
    """FORWARD_TOKENS for `device` (an accelerator other than CUDA counts as CUDA: launch-bound too)."""
    return FORWARD_TOKENS.get(device.type, FORWARD_TOKENS["cuda"])


@torch.inference_mode()
def prefill_prompt(kv, prompt: torch.Tensor, mask: torch.Tensor) -> None:
    """Feed all prompt tokens but the last (the first round feeds the last) into `kv`, a CachedModel or a
    StaticCachedModel with an empty cache; rows of similar length together where that saves compute."""
    if prompt.shape[1] <= 1:
        return
    positions = (mask.long().cumsum(dim=1) - 1).clamp_min(0)
    tokens, positions, valid = prompt[:, :-1], positions[:, :-1], mask[:, :-1].bool()
    groups = padding_groups(valid, forward_tokens(kv.device)) if kv.length == 0 else None
    if groups is None:
        kv.forward(tokens, positions, valid, prefill=True)
        return
    parts = []
    for g in groups:
        # packed as the cache it fills is (a static cache's forwards are not): ssd_packed_linear=False packs nothing
        part = CachedModel(kv.model, len(g.rows), packed_linear=getattr(kv, "packed", None) is not None)
        rows = torch.tensor(g.rows, device=tokens.device)
        part.forward(tokens[rows, g.start:], positions[rows, g.start:], valid[rows, g.start:], prefill=True)
        parts.append((g, part))
    kv.adopt_groups(parts, tokens, positions, valid)
