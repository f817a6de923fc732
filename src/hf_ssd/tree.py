"""Tree drafting geometry: which bonus guesses to fork, and the attention masks of the tree steps.

After the glue forward over [t_prev, d_1..d_K], position j holds the draft's guess of the bonus token if exactly j
drafts are accepted. A branch (j, t) continues t_prev, d_1..d_j, t: in every tree step it attends to the committed
prefix, to glue slots 0..j, and to its own earlier tree slots only. Branches share the prefix KV; nothing is copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Forks:
    tokens: torch.Tensor  # [B, N] guessed bonus token of each branch
    depth: torch.Tensor  # [B, N] j: drafts the branch assumes accepted
    valid: torch.Tensor  # [B, N] bool; rows with fewer branches are padded


def fork(scores: torch.Tensor, drafts: torch.Tensor, n: torch.Tensor, fanout: torch.Tensor) -> Forks:
    """Top-F_j tokens of the glue scores at each position j <= n, excluding d_{j+1} (a rejected draft cannot be
    the bonus); position n (all drafts accepted) excludes nothing.

    scores: [B, K+1, V]; drafts: [B, K]; n: [B]; fanout: [B, K+1] (entries past n are ignored).
    """
    B, P, V = scores.shape
    f_max = int(fanout.max().item()) if fanout.numel() else 0
    top = scores.topk(min(f_max + 1, V), dim=-1).indices.cpu()  # [B, K+1, f_max+1]
    drafts, n, fanout = drafts.cpu(), n.cpu(), fanout.cpu()
    rows: list[list[tuple[int, int]]] = []
    for b in range(B):
        branches = []
        for j in range(int(n[b]) + 1):
            cands = top[b, j].tolist()
            if j < int(n[b]):
                cands = [t for t in cands if t != int(drafts[b, j])]
            branches += [(j, t) for t in cands[: int(fanout[b, j])]]
        rows.append(branches)
    N = max(1, max(len(r) for r in rows))
    tokens = torch.zeros(B, N, dtype=torch.long)
    depth = torch.zeros(B, N, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    for b, branches in enumerate(rows):
        for i, (j, t) in enumerate(branches):
            tokens[b, i], depth[b, i], valid[b, i] = t, j, True
    device = scores.device
    return Forks(tokens.to(device), depth.to(device), valid.to(device))


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


def tree_attend_reference(past_valid, glue_valid, forks: Forks, step: int) -> torch.Tensor:
    """Element-by-element statement of `tree_attend`, used by the tests."""
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
