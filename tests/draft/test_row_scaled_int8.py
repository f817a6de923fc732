"""Row-scaled int8 Linear: each input row is rounded on its own range, as if it had been fed alone."""
from __future__ import annotations

import pytest
import torch

from hf_ssd.draft.quant import int8_copy, quantized_draft
from hf_ssd.draft.row_scaled_int8 import RowScaledInt8Linear
from hf_ssd.testing import get_pair


def _dynamic_int8(lin: torch.nn.Linear) -> torch.nn.Module:
    """The draft copy's plain int8 Linear (without a config every Linear is row-scaled: take what it wraps)."""
    return int8_copy(torch.nn.Sequential(lin))[0].inner


@pytest.mark.parametrize("bias", [False, True])
def test_an_outlying_row_no_longer_coarsens_the_others(bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64, bias=bias)
    shared = _dynamic_int8(lin)
    rows = RowScaledInt8Linear(shared)
    x = torch.randn(2, 6, 256)
    x[0, 0] *= 100  # one token with activations 100x the rest, as real down projections see
    with torch.no_grad():
        ref = lin(x)
        err = lambda out: float((out - ref)[:, 1:].abs().mean() / ref[:, 1:].abs().mean())  # noqa: E731
        alone = torch.stack([torch.cat([shared(x[b, t:t + 1]) for t in range(6)]) for b in range(2)])
        assert err(rows(x)) < 0.1 * err(shared(x))
        assert err(rows(x)) < 1.5 * err(alone) + 1e-3  # as good as feeding each token on its own


def test_one_row_goes_through_the_plain_int8_linear_unchanged():
    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 32)
    shared = _dynamic_int8(lin)
    x = torch.randn(1, 1, 128)
    with torch.no_grad():
        assert torch.equal(RowScaledInt8Linear(shared)(x), shared(x))


def test_the_int8_draft_scales_rows_only_where_linears_read_the_mlp_width():
    draft = get_pair("llama").related
    hidden = draft.config.hidden_size
    wrapped = {n.rsplit(".", 1)[-1] for n, m in quantized_draft(draft, "int8").named_modules()
               if isinstance(m, RowScaledInt8Linear)}
    assert wrapped == {"down_proj"} and draft.config.intermediate_size > hidden
