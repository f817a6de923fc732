"""The int8 draft copy: every Linear quantized with one scale per output channel, close to the float weights."""
from __future__ import annotations

import torch

from hf_ssd.draft.quant import int8_copy, quantized_draft, unquantized
from hf_ssd.testing import get_pair, prompt


def test_int8_copy_quantizes_each_output_channel_on_its_own():
    draft = get_pair("llama").related
    q8 = quantized_draft(draft, "int8")
    assert quantized_draft(draft, "int8") is q8 and unquantized(q8) == (draft, "int8")  # made once, kept
    assert quantized_draft(q8, "int8") is q8  # not a copy of the copy
    linears = [m for m in q8.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert linears and not any(type(m) is torch.nn.Linear for m in q8.modules())
    assert all(m.weight().qscheme() == torch.per_channel_affine for m in linears)


def test_per_channel_weights_track_the_float_draft_closer_than_one_scale_per_matrix():
    """One output row 50x larger than the rest (as real checkpoints have): one scale per matrix rounds the other
    rows to a few levels; per channel they keep their precision."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin.weight[0] *= 50
    model = torch.nn.Sequential(lin)
    x = torch.randn(8, 64)
    ref = model(x)[:, 1:]
    per_tensor = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    per_channel = int8_copy(model)
    err = lambda m: float((m(x)[:, 1:] - ref).abs().mean() / ref.abs().mean())  # noqa: E731
    assert err(per_channel) < 0.2 * err(per_tensor)


def test_int8_draft_logits_stay_close_to_the_float_drafts():
    draft = get_pair("llama").related
    ids = prompt(12, seed=3)
    with torch.no_grad():
        ref = draft(ids).logits.float().softmax(-1)
        got = quantized_draft(draft, "int8")(ids).logits.float().softmax(-1)
    assert float(torch.minimum(ref, got).sum(-1).mean()) > 0.9  # the same model, a little rounded
