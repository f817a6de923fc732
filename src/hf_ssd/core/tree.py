"""Tree drafting geometry: which bonus guesses to fork, and the attention masks of the tree steps.

After the glue forward over [t_prev, d_1..d_K], position j holds the draft's guess of the bonus token if exactly j
drafts are accepted. A branch (j, t) continues t_prev, d_1..d_j, t: in every tree step it attends to the committed
prefix, to glue slots 0..j, and to its own earlier tree slots only. Branches share the prefix KV; nothing is copied.
"""
from __future__ import annotations

import torch

from hf_ssd.core.types import Forks


def fork(
    scores: torch.Tensor,
    drafts: torch.Tensor,
    n: torch.Tensor,
    fanout: torch.Tensor,
    width: int | None = None,
    f_max: int | None = None,
) -> Forks:
    """Top-F_j tokens of the glue scores at each position j <= n, excluding d_{j+1} (a rejected draft cannot be
    the bonus); position n (all drafts accepted) excludes nothing. Branches are ordered by j, then by rank.

    scores: [B, K+1, V]; drafts: [B, K]; n: [B]; fanout: [B, K+1] (entries past n are ignored).
    width: N, branches per row in the result (default: the most any row has; pass the budget for a fixed shape);
    f_max: the largest fan-out (default read from `fanout`). Given both, fork never reads tensors on the host.
    """
    B, P, V = scores.shape
    device = scores.device
    if f_max is None:
        f_max = int(fanout.max()) if fanout.numel() else 0
    top = scores.topk(min(f_max + 1, V), dim=-1).indices  # [B, P, f_max+1]
    j = torch.arange(P, device=device)
    n = n.to(device)
    # Drop the draft at positions that had one (j < n); every position past n is no outcome at all.
    draft_at = torch.cat([drafts.to(device), drafts.new_full((B, 1), -1).to(device)], dim=1)  # [B, P]
    keep = (top != draft_at[:, :, None]) | (j[None, :, None] >= n[:, None, None])
    rank = keep.long().cumsum(dim=-1) - 1
    chosen = keep & (rank < fanout.to(device)[:, :, None]) & (j[None, :, None] <= n[:, None, None])
    chosen = chosen.reshape(B, -1)
    if width is None:
        width = max(1, int(chosen.sum(dim=1).max()))
    slot = torch.where(chosen, chosen.long().cumsum(dim=1) - 1, width)  # unchosen -> a spill column
    slot = slot.clamp_max(width)

    def place(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((B, width + 1), fill, dtype=values.dtype, device=device)
        return out.scatter_(1, slot, values)[:, :width]

    depth = j[None, :, None].expand_as(top).reshape(B, -1)
    return Forks(place(top.reshape(B, -1), 0), place(depth, 0), place(chosen, False))


def tree_width(config, K: int, budget: int, vocab_size: int) -> int:
    """N: branches per row in every tree step. The budget (as SaguaroDrafter clamps it), or more if an explicit
    fan-out list asks for more (a row never has more branches than the sum of its schedule)."""
    n = max(1, min(budget, (K + 1) * (vocab_size - 1) + 1))
    for fixed in (config.fanout, config.fanout_after_miss):
        if fixed is not None:
            n = max(n, sum(fixed))
    return n


def tree_attend(past_valid: torch.Tensor, glue_valid: torch.Tensor, forks: Forks, step: int) -> torch.Tensor:
    """[B, N, L0 + (K+1) + step*N] bool mask of tree step `step` (1-based): committed prefix, glue slots up to the
    branch's depth, and the branch's own slots in steps 1..step."""
    B, N = forks.tokens.shape
    P = glue_valid.shape[1]
    device = past_valid.device
    past = past_valid[:, None, :].expand(B, N, past_valid.shape[1])
    glue = (torch.arange(P, device=device)[None, None, :] <= forks.depth[:, :, None]) & glue_valid[:, None, :]
    own = torch.eye(N, dtype=torch.bool, device=device)[None] & forks.valid[:, None, :]
    return torch.cat([past, glue] + [own] * step, dim=2)

