"""Plain decoding in our loop from a call's start (control.plain_loop): where a padded batch makes
transformers' prefill dear, a call that decodes plain runs our loop's grouped prefill and one-token rounds instead
of handing off; the output is plain generate()'s."""
from __future__ import annotations

import pytest
import torch

from hf_ssd.control.compiled import plan_graphs
from hf_ssd.control.controller import Controller
from hf_ssd.control.costs import Costs, Curve
from hf_ssd.control.decision import Horizon
from hf_ssd.control.memory import Memory, record_prefill
from hf_ssd.control.plan import Plan
from hf_ssd.runtime.static_choice import TARGET_K_MAX
from hf_ssd.runtime.static_kv import static_cache_len
from hf_ssd.testing import get_pair, left_pad, prompt

PLAIN = Plan("plain")


def plain_only(batch: int = 4) -> Controller:
    """A controller whose only plan is plain decoding, with a target step of 0.1 s and a prefill price of 10 ms a
    padded column on either path."""
    line = Curve.straight(0.1, 0.002)
    costs = Costs(batch, line, line, line, line, (1, 1))
    ctl = Controller(costs, Memory(), batch, {"mode": ("plain",)}, fixed_alpha=0.5)
    record_prefill(ctl.memory, "plain", 3.0, 300)
    record_prefill(ctl.memory, "engine", 3.0, 300)
    return ctl


def test_a_padded_batch_decodes_plain_in_our_loop():
    """300 prompt columns, of which our grouped prefill runs 40%: handed off, the call pays 1.8 s more prefill over
    64 tokens a row (about 6.4 s of decoding), so plain runs in our loop; with no padding to skip it hands off."""
    ctl = plain_only()
    padded = ctl.decide(horizon=Horizon(64, 300, prefill_share=0.4))
    assert padded.plan == PLAIN and padded.in_loop
    assert padded.reason.startswith("plain in our loop")
    loop = next(p for p in padded.table if p.plan == PLAIN)
    assert loop.parts["prefill"] == pytest.approx(0.0)  # the cheaper path: it pays no difference
    handed_off = 256 / (256 / loop.tokens_per_s + 1.8)  # 64 tokens x 4 rows, and 3.0 - 1.2 s more prefill
    assert loop.call_tokens_per_s > 1.2 * handed_off
    even = ctl.decide(horizon=Horizon(64, 300, prefill_share=1.0))
    assert even.plan == PLAIN and not even.in_loop


def test_plain_in_our_loop_competes_with_the_drafting_plans():
    """Synchronous SD, 0.9x plain per round here, beats plain handed off only by the padded prefill it skips; plain
    in our loop skips it too and wins."""
    line = Curve.straight(0.1, 0.002)
    costs = Costs(4, line, Curve.straight(0.02, 0.0), line, line, (1, 1))
    ctl = Controller(costs, Memory(), 4, {"mode": ("plain", "sync"), "K": (2,)}, fixed_alpha=0.3)
    record_prefill(ctl.memory, "plain", 3.0, 300)
    record_prefill(ctl.memory, "engine", 3.0, 300)
    sync, plain = ctl.predict(Plan("sync", 2)), ctl.predict(PLAIN)
    assert 0.8 * plain.tokens_per_s < sync.tokens_per_s < plain.tokens_per_s
    decision = ctl.decide(horizon=Horizon(64, 300, prefill_share=0.4))
    assert decision.plan == PLAIN and decision.in_loop
    ctl.memory.in_loop_plain.add(0.3, count=8)  # our loop's plain steps measured three times the hand-off's
    assert ctl.decide(horizon=Horizon(64, 300, prefill_share=0.4)).plan == Plan("sync", 2)


def test_our_loops_measured_plain_steps_price_it():
    """Once plain steps in our loop have run, their measured seconds price them: at twice the hand-off's step the
    prefill they save does not repay them, and the call hands off."""
    ctl = plain_only()
    for _ in range(8):
        ctl.memory.in_loop_plain.add(0.2)
    decision = ctl.decide(horizon=Horizon(64, 300, prefill_share=0.4))
    assert not decision.in_loop
    parts = decision.table[0].parts  # the hand-off's record says what our loop was priced at
    assert parts["in_our_loop_round_s"] == pytest.approx(0.2) and parts["in_our_loop_call_tok_s"] < 4 / 0.2


def test_plain_in_our_loop_runs_the_compiled_one_token_graph():
    """On a compiled target our loop's plain steps run its one-token graph (runtime.static_choice.VERIFY_WIDTHS), a
    graph the controller charges like any other; a hand-off runs transformers' compiled loop; no draft graph."""
    slots = ("slots", static_cache_len(128, TARGET_K_MAX, 0))
    assert plan_graphs(PLAIN, True, True, in_loop=True, max_length=128) == {("target", 1, slots)}
    assert plan_graphs(PLAIN, True, True, in_loop=False, max_length=128) == {("plain",)}
    assert plan_graphs(PLAIN, True, False, in_loop=True, max_length=128) == frozenset()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_plain_in_our_loop_is_plain_generate(monkeypatch, arch):
    """A batch of two prompts of different lengths, decoded plain in our loop from the start: token-identical to
    plain generate(), and the stats say where it ran."""
    from hf_ssd.control import controller as ctl_mod

    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None: ctl_mod.Decision(
        PLAIN, "test: plain in our loop", [], in_loop=True))
    p = get_pair(arch)
    ids, mask = left_pad([prompt(5, seed=60)[0], prompt(13, seed=61)[0]])
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = p.target.generate(ids, **kw)
    with torch.no_grad():
        out = p.target.generate(ids, assistant_model=p.related, ssd=True, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    st = out.ssd_stats
    assert st["mode"] == "plain" and st["rounds"] > 0 and st["controller"]["reason"] == "test: plain in our loop"


def test_greedy_plain_in_our_loop_measures_alpha_along_its_answer(monkeypatch):
    """Plain observes no α: where the controller asks (exploration.plain_measurement), the draft reads it off the
    answer afterwards, as after a hand-off, and the memory's α rests on it."""
    from hf_ssd import session
    from hf_ssd.control import controller as ctl_mod

    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None: ctl_mod.Decision(
        PLAIN, "test: plain in our loop", [], in_loop=True))
    monkeypatch.setattr(session, "plain_measurement", lambda controller, decision, horizon: Plan("sync", 2))
    p = get_pair("llama")
    ids, mask = left_pad([prompt(6, seed=62)[0], prompt(9, seed=63)[0]])
    with torch.no_grad():
        out = p.target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                assistant_model=p.related, ssd=True, return_dict_in_generate=True)
    measured = out.ssd_stats["controller"]["plain_alpha"]
    assert measured["positions"] == 20 and 0.0 <= measured["alpha"] <= 1.0 and measured["draft"] == "sync K=2"


def test_compiled_target_runs_plain_in_our_loop_on_its_one_token_graph(monkeypatch):
    """ssd_compile_target, plain in our loop from the start: the target's one-token width compiles, the output is
    plain generate()'s, and a second call builds no graph and recompiles nothing."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from hf_ssd.control import controller as ctl_mod
    from hf_ssd.runtime import static_registry
    from hf_ssd.testing import plain_generate, ssd_generate

    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None: ctl_mod.Decision(
        PLAIN, "test: plain in our loop", [], in_loop=True))
    p = get_pair("qwen2")
    ids, mask = left_pad([prompt(9, seed=64)[0], prompt(4, seed=65)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24)
    kw = dict(attention_mask=mask, max_new_tokens=24, return_dict_in_generate=True, ssd_compile_target=True,
              ssd_mode="auto", ssd_num_draft_tokens=None, ssd_budget=None)  # the controller's (patched) choice
    counters.clear()
    with inductor_config.patch(compile_threads=1):
        first = ssd_generate(p.target, p.related, ids, **kw)
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = ssd_generate(p.target, p.related, ids, **kw)
    assert torch.equal(first.sequences, ref) and torch.equal(out.sequences, ref)
    assert out.ssd_stats["mode"] == "plain" and out.ssd_stats["rounds"] >= 20
    assert counters["stats"]["unique_graphs"] == graphs > 0 and not counters["graph_break"]
    entries = [e for e in static_registry.registry_entries(p.target) if e.batch == 2]
    assert any(1 in e.compiled_widths for e in entries) and all(e.compile_failed is None for e in entries)
