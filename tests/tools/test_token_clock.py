"""TokenClock (the demo's per-token timer): it skips the prompt, counts every new token once, in order, from
the engine's multi-token chunks and from plain decoding alike, and refuses a token it never saw."""
from __future__ import annotations

import pytest
import torch

from hf_ssd.testing import get_pair, plain_generate, prompt, ssd_generate
from hf_ssd.tools.token_clock import TokenClock


def test_counts_new_tokens_not_the_prompt():
    clock = TokenClock()
    clock.start()
    clock.put(torch.arange(7))  # the prompt
    clock.put(torch.tensor([1, 2, 3]))
    clock.put(torch.tensor(4))
    assert len(clock.arrivals) == 4
    assert clock.arrivals[0] == clock.arrivals[2] <= clock.arrivals[3]
    assert 0 <= clock.seconds_to(1) <= clock.seconds_to(4)
    with pytest.raises(ValueError, match="saw 4 new tokens"):
        clock.seconds_to(5)
    clock.start()  # a reused clock starts over
    assert clock.arrivals == []


@pytest.mark.parametrize("use_ssd", [False, True])
def test_sees_every_generated_token(use_ssd):
    p = get_pair("llama")
    ids = prompt(6, seed=3)
    clock = TokenClock()
    clock.start()
    if use_ssd:
        out = ssd_generate(p.target, p.same, ids, max_new_tokens=14, streamer=clock, ssd_num_draft_tokens=4)
    else:
        out = plain_generate(p.target, ids, max_new_tokens=14, streamer=clock)
    assert len(clock.arrivals) == out.shape[1] - 6 == 14
    assert clock.arrivals == sorted(clock.arrivals)
