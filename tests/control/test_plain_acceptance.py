"""α measured along the answer of a call that ran plain decoding (control.plain_acceptance): it matches the
acceptance computed position by position, leaves the output alone, and keeps the controller's α moving."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from hf_ssd.control import plain_acceptance
from hf_ssd.control.controller import Controller
from hf_ssd.control.decision import Horizon
from hf_ssd.control.exploration import plain_measurement
from hf_ssd.control.memory import Memory
from hf_ssd.control.plain_acceptance import PlainProbe, TargetTopProbs, answer_mask, measure
from hf_ssd.control.plan import Acceptance, Plan
from hf_ssd.draft.model import DraftModel
from hf_ssd.testing import VOCAB, get_pair, left_pad, plain_generate, prompt

from tests.control.test_controller import costs

T = 0.8


def reference(target, draft, rows: list[torch.Tensor], prompt_lens: list[int], greedy: bool) -> float:
    """Summed acceptance, one forward per position over each row's unpadded prefix: greedy, argmax agreement with the
    token the target chose; sampled, sum_x min(p, q) of the two temperature-scaled distributions."""
    total = 0.0
    with torch.no_grad():
        for row, P in zip(rows, prompt_lens):
            for i in range(P, row.shape[0]):
                prefix = row[:i].unsqueeze(0)
                q_logits = draft(prefix).logits[0, -1, :VOCAB]
                if greedy:
                    total += float(q_logits.argmax() == row[i])
                    continue
                p = (target(prefix).logits[0, -1, :VOCAB] / T).softmax(-1)
                q = (q_logits / T).softmax(-1)
                total += float(torch.minimum(p, q).sum())
    return total


@pytest.mark.parametrize("greedy", [True, False])
def test_measured_acceptance_matches_the_position_by_position_reference(monkeypatch, greedy):
    """Two left-padded rows of different prompt lengths, one cut by an end-of-sequence token: the chunked
    measurement equals the per-position reference over the tokens each row really generated."""
    monkeypatch.setattr(plain_acceptance, "TOP", VOCAB)  # every token's probability kept: the sum is exact
    monkeypatch.setattr(plain_acceptance, "CHUNK", 3)  # the answer over several chunks of the draft's cache
    p = get_pair("llama")
    prompts = [prompt(5, seed=11)[0], prompt(8, seed=12)[0]]
    ids, mask = left_pad(prompts)
    kept = TargetTopProbs()
    # transformers puts a caller's processors before its own warpers: the temperature goes in by hand, before `kept`
    processors = [] if greedy else [TemperatureLogitsWarper(T), kept]
    kw = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0, do_sample=not greedy, top_k=0, top_p=1.0)
    torch.manual_seed(3)
    full = p.target.generate(ids, logits_processor=LogitsProcessorList(processors), **kw)
    eos = int(full[0, ids.shape[1] + 4])  # row 0 ends at its 5th new token (or sooner)
    kept.steps.clear()
    torch.manual_seed(3)
    out = p.target.generate(ids, logits_processor=LogitsProcessorList(processors), eos_token_id=eos, **kw)
    warpers = LogitsProcessorList([] if greedy else [TemperatureLogitsWarper(T)])
    draft = DraftModel(p.related, 0, VOCAB, warpers, greedy, 1.0, None)
    got = measure(draft, out, ids.shape[1], mask, [eos], None if greedy else kept)

    valid = answer_mask(out[:, ids.shape[1]:], [eos])
    rows = [torch.cat([pr, out[b, ids.shape[1]:][valid[b]]]) for b, pr in enumerate(prompts)]
    assert got.positions == int(valid.sum()) and valid[0].sum() <= 5
    want = reference(p.target, p.related, rows, [len(pr) for pr in prompts], greedy)
    assert got.accepted == pytest.approx(want, abs=1e-4)
    assert got.accepted + got.rejected == pytest.approx(got.positions)


def test_the_draft_that_is_the_target_is_always_accepted():
    p = get_pair("llama")
    ids = prompt(6, seed=4)
    out = plain_generate(p.target, ids, max_new_tokens=8)
    got = measure(DraftModel(p.target, 0, VOCAB, LogitsProcessorList(), True, 1.0, None), out, ids.shape[1],
                  torch.ones_like(ids), [], None)
    assert got.alpha == 1.0 and got.positions == 8


def test_kept_target_probabilities_bound_the_acceptance_from_below(monkeypatch):
    """Only the TOP likeliest target tokens are kept: the measured acceptance is a lower bound, short of the exact
    sum by at most the target's probability outside them."""
    monkeypatch.setattr(plain_acceptance, "TOP", 8)
    p = get_pair("llama")
    ids = prompt(6, seed=5)
    kept = TargetTopProbs()
    torch.manual_seed(1)
    out = p.target.generate(ids, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(T), kept]),
                            max_new_tokens=8, do_sample=True, top_k=0, top_p=1.0, pad_token_id=0)
    draft = DraftModel(p.related, 0, VOCAB, LogitsProcessorList([TemperatureLogitsWarper(T)]), False, 1.0, None)
    got = measure(draft, out, ids.shape[1], torch.ones_like(ids), [], kept)
    exact = reference(p.target, p.related, [out[0]], [ids.shape[1]], greedy=False)
    tail = sum(1.0 - float(values.sum()) for values, _ in kept.steps)
    assert exact - tail - 1e-4 <= got.accepted <= exact + 1e-4


def test_answer_mask_stops_after_the_first_end_token():
    answer = torch.tensor([[5, 7, 2, 0, 0], [5, 5, 5, 5, 5], [2, 2, 9, 9, 9]])
    assert answer_mask(answer, [2]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert answer_mask(answer, []).all()


def close_call_controller(memory: Memory, **kw) -> Controller:
    """Plain is the pick at the measured α = 0.7, with sync K=1 predicted within 95% of it (as in
    test_plain_on_an_unmeasured_alpha_is_explored_and_then_left_alone), and α rests on enough rounds not to explore."""
    memory.add_acceptance(70.0, 30.0, rounds=100)
    return Controller(costs(draft=(0.08, 0.0005), split=2.0), memory, 1, {}, prior=Acceptance(alpha=0.7), **kw)


def test_a_close_plain_choice_asks_for_a_measurement():
    horizon = Horizon(tokens=64, context=100)
    ctl = close_call_controller(Memory())
    first = ctl.decide(horizon=horizon)
    assert first.plan == Plan("plain") and first.drafting.plan.mode == "sync"
    assert plain_measurement(ctl, first, horizon) == first.drafting.plan
    # not with a fixed α, nor where the draft's forward over context and answer costs too much of the call
    assert plain_measurement(close_call_controller(Memory(), fixed_alpha=0.7), first, horizon) is None
    assert plain_measurement(ctl, first, Horizon(tokens=64, context=20_000)) is None
    # nor where drafting is far slower than plain: a better α would not change the choice
    useless = Controller(costs(draft=(0.3, 0.002), split=2.0), Memory(), 1, {}, prior=Acceptance(alpha=0.7))
    far = useless.decide(horizon=horizon)
    assert far.plan == Plan("plain") and plain_measurement(useless, far, horizon) is None


def test_plain_calls_measure_alpha_once_every_few_calls():
    """A measurement serves the calls after it: the next MEASURE_EVERY - 1 plain calls do not pay for another."""
    from hf_ssd.control.exploration import MEASURE_EVERY

    horizon = Horizon(tokens=64, context=100)
    memory = Memory()
    ctl = close_call_controller(memory)
    first = ctl.decide(horizon=horizon)
    measured = []
    for _ in range(2 * MEASURE_EVERY):
        measured.append(plain_measurement(ctl, first, horizon) is not None)
        memory.end_call()
    assert measured == ([True] + [False] * (MEASURE_EVERY - 1)) * 2


@pytest.mark.parametrize("do_sample,int8", [(False, False), (True, True)])
def test_a_plain_call_measures_alpha_and_its_output_stays_plains(monkeypatch, do_sample, int8):
    """End to end: the controller picks plain on a close call, transformers' loop makes exactly plain generate()'s
    output (same seed, same samples), and the draft's acceptance along it moves the controller's α: the α of the
    draft's precision the best drafting plan runs (int8: an int8 line cheap enough to make its plans the best)."""
    from hf_ssd import session

    memory = Memory()
    monkeypatch.setattr(session, "memory_for", lambda key: memory)
    line = (0.07, 0.0005) if int8 else None
    monkeypatch.setattr(session, "measure_costs", lambda *a, **k: costs(draft=(0.08, 0.0005), split=2.0, int8=line))
    memory.add_acceptance(70.0, 30.0, rounds=100)
    p = get_pair("llama")
    ids = prompt(7, seed=21)
    kw = dict(max_new_tokens=24, do_sample=do_sample, pad_token_id=0)  # long enough to pay one draft forward
    if do_sample:
        kw.update(temperature=T, top_k=0, top_p=1.0)
    torch.manual_seed(9)
    ref = p.target.generate(ids, **kw)
    torch.manual_seed(9)
    out = p.target.generate(ids, assistant_model=p.related, ssd=True, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    measured = out.ssd_stats["controller"]["plain_alpha"]
    assert out.ssd_stats["mode"] == "plain" and measured["positions"] == 24
    assert memory.accepted + memory.rejected == pytest.approx(100.0 + 24)
    assert memory.accepted == pytest.approx(70.0 + measured["alpha"] * 24, abs=0.02)
    tally = memory.tallies[int8]
    assert tally.accepted + tally.rejected == pytest.approx(24 + (0 if int8 else 100))
