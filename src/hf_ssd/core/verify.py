"""Exact verification of a speculative block: pure tensor functions, no model inside.

Shapes: B rows, K draft slots, V vocabulary. `n_drafts[b] <= K` is how many slots of row b hold real drafts (a
backup may propose fewer); slots past it are never accepted. The result per row is the verification outcome
(k accepted, bonus token t*), which is also the key of the speculation cache.
"""
from __future__ import annotations

import torch

from hf_ssd.core.sampling import sample
from hf_ssd.core.types import Outcome


def leading_true(ok: torch.Tensor) -> torch.Tensor:
    """Length of the run of True at the start of each row of a [B, K] bool tensor."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def draft_slots(n_drafts: torch.Tensor, K: int) -> torch.Tensor:
    return torch.arange(K, device=n_drafts.device)[None, :] < n_drafts[:, None]


def acceptance_uniforms(B: int, K: int, generator, device, dtype) -> torch.Tensor:
    """The u ~ U[0, 1) of the ratio test, one per draft slot (a seam the exact-enumeration tests replace)."""
    return torch.rand(B, K, generator=generator, device=device, dtype=dtype)


def verify_greedy(drafts: torch.Tensor, n_drafts: torch.Tensor, target_scores: torch.Tensor) -> Outcome:
    """Accept while the draft equals the target's argmax; the bonus is the argmax at the first mismatch.

    target_scores: [B, K+1, V] processed target scores.
    """
    choice = target_scores.argmax(dim=-1)  # [B, K+1]
    K = drafts.shape[1]
    ok = (drafts == choice[:, :K]) & draft_slots(n_drafts, K)
    k = leading_true(ok)
    return Outcome(k, choice.gather(1, k[:, None]).squeeze(1))


def verify_sampled(
    drafts: torch.Tensor,
    n_drafts: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Outcome:
    """Speculative sampling (Leviathan et al.): accept d_i with prob min(1, p_i(d_i)/q_i(d_i)); at the first rejection
    draw the bonus from max(p_i - q_i, 0); after full acceptance draw it from p at the next position.

    p: [B, K+1, V] target probabilities; q: [B, K, V] the exact distributions the drafts were drawn from. A
    deterministic proposal is a point mass (see `point_mass`): accept with prob p(x), residual = p without x.
    """
    B, K = drafts.shape
    p_d = p[:, :K].gather(2, drafts[..., None]).squeeze(2)
    q_d = q.gather(2, drafts[..., None]).squeeze(2)
    u = acceptance_uniforms(B, K, generator, p.device, p.dtype)
    ok = (u * q_d < p_d) & draft_slots(n_drafts, K)
    k = leading_true(ok)
    rows = torch.arange(B, device=p.device)
    p_k = p[rows, k]  # [B, V]
    rejected = k < n_drafts
    q_k = torch.zeros_like(p_k)
    q_k[rejected] = q[rows[rejected], k[rejected]]
    residual = (p_k - q_k).clamp_min(0)
    # A rejection with an all-zero residual has probability 0 in exact arithmetic; fall back to p if rounding hits it.
    empty = residual.sum(dim=-1) <= 0
    residual[empty] = p_k[empty]
    return Outcome(k, sample(residual / residual.sum(dim=-1, keepdim=True), generator))
