"""Drawing tokens, and the distributions drafts are drawn from: plain, point mass, and Saguaro's sigma_{F,C}."""
from __future__ import annotations

import torch


BAD_PROBS = "probability tensor contains either `inf`, `nan` or element < 0"


def check_probs(probs: torch.Tensor) -> None:
    """Raise RuntimeError (the message torch.multinomial gives plain generate()) if any entry is NaN, inf or < 0.

    One reduction over the whole tensor and one host read per call. A NaN must never become a token: the search
    below would turn it into the last vocabulary id. On the draft side the error is a draft failure (the fallback
    chain takes over); on the target side it reaches the caller, as in plain sampling."""
    if probs.numel() == 0:
        return
    low, high = torch.aminmax(probs)
    if not bool((low >= 0) & (high < float("inf"))):  # NaN fails both comparisons
        raise RuntimeError(BAD_PROBS)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, check: bool = True) -> torch.Tensor:
    """One token per row of a [..., V] probability tensor (rows need not be normalised).

    Inverse-CDF sampling on a float64 cumulative sum: one uniform per row and a binary search, ~10x faster than
    torch.multinomial on a 150k vocabulary, and tokens with zero probability are never drawn. Non-finite or
    negative entries raise RuntimeError (`check_probs`); check=False skips that host read (the caller checks later,
    before any drawn token is used).
    """
    V = probs.shape[-1]
    if check:
        check_probs(probs)
    cdf = probs.reshape(-1, V).double().cumsum(dim=-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_max(V - 1).reshape(probs.shape[:-1])


def point_mass(tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q for a deterministic proposal: one-hot on the proposed token."""
    q = torch.zeros(*tokens.shape, vocab_size, dtype=dtype, device=tokens.device)
    return q.scatter_(-1, tokens[..., None], 1.0)


def saguaro_probs(scores: torch.Tensor, fanout: torch.Tensor | int, downweight: float) -> torch.Tensor:
    """sigma_{F,C}: softmax of the processed scores with the top-F tokens' mass multiplied by C, renormalised.

    scores: [..., V]; fanout: F per row (broadcast over the leading dims) or an int. C = 1 is plain softmax.
    Tokens masked to -inf by warpers stay at probability 0.
    """
    probs = torch.softmax(scores.float(), dim=-1)
    if downweight >= 1.0 or (isinstance(fanout, int) and fanout == 0):
        return probs
    if isinstance(fanout, int):  # one F for every row: the same weights, without a host read
        top = probs.topk(min(fanout, probs.shape[-1]), dim=-1).indices
        weighted = probs * torch.ones_like(probs).scatter_(-1, top, downweight)
        total = weighted.sum(dim=-1, keepdim=True)
        return torch.where(total > 0, weighted / total.clamp_min(torch.finfo(probs.dtype).tiny), probs)
    F = torch.as_tensor(fanout, device=scores.device).expand(scores.shape[:-1])
    f_max = int(F.max().item()) if F.numel() else 0
    if f_max == 0:
        return probs
    top = probs.topk(min(f_max, probs.shape[-1]), dim=-1).indices  # [..., f_max]
    use = torch.arange(top.shape[-1], device=scores.device) < F[..., None]
    weights = torch.ones_like(probs).scatter_(-1, top, torch.where(use, downweight, 1.0).to(probs.dtype))
    weighted = probs * weights
    total = weighted.sum(dim=-1, keepdim=True)
    # C = 0 with all mass in the top-F leaves nothing: then sigma is undefined; keep plain softmax there.
    return torch.where(total > 0, weighted / total.clamp_min(torch.finfo(probs.dtype).tiny), probs)
