"""A dynamic int8 Linear that quantizes each row (token) of its input on that row's own range.

torch's dynamic int8 Linear takes one activation range over the whole call. Fed one token at a time that range is
the token's own; but a speculation tree feeds a dozen branch tokens through one forward and a prompt prefill
hundreds, and the MLP's down projection sees a few tokens with activations far larger than the rest: their range
then coarsens every other token's rounding. On the default pair's draft the tree's q overlapped the float draft's
by 0.85 against 0.94 for the same tokens fed one at a time, and 0.92 with each row on its own range.

Each row is divided by its largest magnitude before the int8 GEMM, so the call's shared range is every row's own,
and multiplied back after. Zero stays exact (as it is in torch's own rounding): most of the down projection's
inputs are near zero, and a map that shifted them (centring each row) rounded them all the same way.
"""
from __future__ import annotations

import torch
from torch import nn


class RowScaledInt8Linear(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner  # a torch.ao dynamic quantized Linear
        self._bias = inner.bias()  # read once: each read unpacks the whole packed weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if len(rows) == 1:  # one row already gets its own range
            return self.inner(x)
        scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12)
        out = self.inner(rows / scale)  # W·x/s + bias
        bias = self._bias
        out = out * scale if bias is None else torch.addcmul(bias, out - bias, scale)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def weight(self) -> torch.Tensor:
        return self.inner.weight()

    def bias(self) -> torch.Tensor | None:
        return self._bias
