"""generate() features around the decoding loop: streamers, output dicts, stats, seeding, pipeline, pass-through."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GenerationMixin, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import hf_ssd
from hf_ssd.testing import (PAD, char_tokenizer, get_pair, left_pad, plain_generate, prompt, ssd_generate,
                            word_tokenizer)

MODES = ["sync", "ssd"]


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        assert self.ended == 0, "put() after end()"
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


# ---- streamers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_streamer_receives_prompt_then_chunks(mode):
    p = get_pair("llama")
    ids = prompt(6, seed=3)
    ref = plain_generate(p.target, ids, max_new_tokens=14)
    eos = int(ref[0, 6 + 9])  # stop inside a block: nothing after EOS may be streamed
    ref = plain_generate(p.target, ids, max_new_tokens=14, eos_token_id=eos)
    rec = Recorder()
    out = ssd_generate(p.target, p.same, ids, max_new_tokens=14, eos_token_id=eos, streamer=rec, ssd_mode=mode,
                       ssd_num_draft_tokens=4)
    assert torch.equal(out, ref)
    assert rec.ended == 1
    assert rec.puts[0] == ids[0].tolist()
    chunks = rec.puts[1:]
    assert len(chunks) < out.shape[1] - 6, "draft == target: tokens should arrive in multi-token chunks"
    assert sum(chunks, []) == out[0, 6:].tolist()
    assert sum(chunks, [])[-1] == eos


def test_text_iterator_streamer_matches_plain():
    p = get_pair("qwen2")
    tok = word_tokenizer()
    ids = prompt(5, seed=4)
    texts = []
    for use_ssd in (False, True):
        streamer = TextIteratorStreamer(tok, skip_prompt=True)
        kw = dict(assistant_model=p.related, ssd=True, ssd_num_draft_tokens=3, ssd_budget=4) if use_ssd else {}
        with torch.no_grad():
            out = p.target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=PAD, streamer=streamer, **kw)
        texts.append("".join(streamer))
        assert texts[-1].strip() == tok.decode(out[0, 5:]).strip()
    assert texts[0] == texts[1]


def test_stop_strings_with_tokenizer():
    p = get_pair("qwen2")
    tok = char_tokenizer()
    ids = prompt(5, seed=4)
    free = plain_generate(p.target, ids, max_new_tokens=12)
    stop = tok.decode(free[0, 5 + 4 : 5 + 6])  # the 5th and 6th generated characters
    kw = dict(max_new_tokens=12, stop_strings=[stop], tokenizer=tok)
    ref = plain_generate(p.target, ids, **kw)
    out = ssd_generate(p.target, p.same, ids, ssd_num_draft_tokens=4, **kw)
    assert ref.shape[1] < free.shape[1]
    assert torch.equal(out, ref)


# ---- output dicts ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_scores_and_logits_match_plain(mode):
    p = get_pair("gemma3")
    ids, mask = left_pad([prompt(9, seed=5)[0], prompt(4, seed=6)[0]])
    kw = dict(attention_mask=mask, max_new_tokens=10, repetition_penalty=1.4, output_scores=True, output_logits=True,
              return_dict_in_generate=True)
    ref = plain_generate(p.target, ids, **kw)
    out = ssd_generate(p.target, p.related, ids, ssd_mode=mode, ssd_num_draft_tokens=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert isinstance(out, hf_ssd.SSDGenerateOutput)
    for name in ("scores", "logits"):
        a, b = getattr(out, name), getattr(ref, name)
        assert len(a) == len(b) == 10
        for t, (x, y) in enumerate(zip(a, b)):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y.float(), atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}[{t}]: {m}")


def test_no_scores_unless_asked():
    p = get_pair("llama")
    out = ssd_generate(p.target, p.related, prompt(4), max_new_tokens=5, return_dict_in_generate=True)
    assert out.scores is None and out.logits is None and out.sequences.shape == (1, 9)


# ---- stats -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_ssd_stats(mode):
    p = get_pair("mistral")
    ids, mask = left_pad([prompt(7, seed=7)[0], prompt(3, seed=8)[0]])
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=15, ssd_mode=mode,
                       ssd_num_draft_tokens=3, return_dict_in_generate=True)
    s = out.ssd_stats
    for key in ("rounds", "drafted", "accepted", "mean_accepted", "target_forwards", "draft_forwards", "wall_time_s",
                "hit_rate"):
        assert key in s, key
    assert s["mode"] == mode
    assert 0 < s["accepted"] <= s["drafted"] <= 3 * 2 * s["rounds"]
    assert s["emitted"] == 2 * 15
    assert 0 <= s["mean_accepted"] <= 3
    # a rejection ends a round short of its K drafts (a round may also draft fewer near max_new_tokens)
    assert 0 < s["rejected"] <= sum(c for k, c in s["accept_hist"].items() if int(k) < 3)
    assert s["target_forwards"] == s["rounds"] + 1  # one prefill, then one verify per round
    assert s["draft_forwards"] > 0 and s["wall_time_s"] > 0
    if mode == "sync":
        assert s["hit_rate"] is None
    else:
        assert 0.0 <= s["hit_rate"] <= 1.0
        # one lookup per row after every round but its last (the first speculation is drafted just in time)
        assert s["cache_lookups"] == sum(r - 1 for r in s["per_row"]["rounds"])
        assert s["hit_rate"] == round(s["cache_hits"] / s["cache_lookups"], 4)
    assert hf_ssd.last_stats() == s
    # also without return_dict_in_generate
    ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=4, ssd_mode=mode)
    assert hf_ssd.last_stats()["emitted"] == 8


def test_default_budget_is_measured():
    p = get_pair("llama")
    ids = prompt(6, seed=16)
    with torch.no_grad():
        out = p.target.generate(ids, assistant_model=p.related, ssd=True, ssd_mode="ssd", ssd_num_draft_tokens=3,
                                max_new_tokens=8,
                                pad_token_id=PAD, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain_generate(p.target, ids, max_new_tokens=8))
    assert out.ssd_stats["budget"] >= 4  # at least K+1: one guess per k
    assert sum(out.ssd_stats["fanout_after_hit"]) == out.ssd_stats["budget"]


# ---- seeding -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_seeded_reproducibility(mode):
    p = get_pair("qwen3")
    ids, mask = left_pad([prompt(5, seed=9)[0], prompt(8, seed=10)[0]] * 2)
    # the backup fixed: the automatic one decides from measured times (README, `backup`)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=1.5, ssd_mode=mode,
              ssd_num_draft_tokens=3, ssd_backup="jit")
    a = ssd_generate(p.target, p.related, ids, generator=torch.Generator().manual_seed(123), **kw)
    b = ssd_generate(p.target, p.related, ids, generator=torch.Generator().manual_seed(123), **kw)
    c = ssd_generate(p.target, p.related, ids, generator=torch.Generator().manual_seed(124), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    transformers.set_seed(7)
    d = ssd_generate(p.target, p.related, ids, **kw)
    transformers.set_seed(7)
    e = ssd_generate(p.target, p.related, ids, **kw)
    assert torch.equal(d, e)


# ---- pipeline ----------------------------------------------------------------------------------------------------------
def test_pipeline_text_generation():
    p = get_pair("llama")
    tok = word_tokenizer()
    pipe = transformers.pipeline("text-generation", model=p.target, tokenizer=tok, device="cpu")
    text = "w5 w17 w33 w8 w41"
    kw = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    plain = pipe(text, **kw)
    fast = pipe(text, assistant_model=p.related, ssd=True, ssd_mode="ssd", ssd_num_draft_tokens=3, ssd_budget=4, **kw)
    assert plain[0]["generated_text"] == fast[0]["generated_text"]
    assert len(plain[0]["generated_text"].split()) >= 5
    assert hf_ssd.last_stats() is not None and hf_ssd.last_stats()["drafted"] > 0


# ---- pass-through without ssd=True ----------------------------------------------------------------------------------------
def test_generate_without_ssd_is_unchanged():
    p = get_pair("gpt2")
    ids, mask = left_pad([prompt(5, seed=11)[0], prompt(9, seed=12)[0]])
    kw = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=PAD)
    assert hf_ssd.is_enabled()
    with torch.no_grad():
        on_greedy = p.target.generate(ids, **kw)
        transformers.set_seed(3)
        on_sample = p.target.generate(ids, do_sample=True, **kw)
        on_assisted = p.target.generate(ids[:1], attention_mask=mask[:1], assistant_model=p.related,
                                        max_new_tokens=8, pad_token_id=PAD)
        hf_ssd.disable()
        try:
            assert not hf_ssd.is_enabled()
            assert GenerationMixin.generate is hf_ssd.hf.generate._ORIGINAL_GENERATE
            off_greedy = p.target.generate(ids, **kw)
            transformers.set_seed(3)
            off_sample = p.target.generate(ids, do_sample=True, **kw)
            off_assisted = p.target.generate(ids[:1], attention_mask=mask[:1], assistant_model=p.related,
                                             max_new_tokens=8, pad_token_id=PAD)
        finally:
            hf_ssd.enable()
    assert hf_ssd.is_enabled()
    assert torch.equal(on_greedy, off_greedy)
    assert torch.equal(on_sample, off_sample)
    assert torch.equal(on_assisted, off_assisted)


def test_enable_one_model_only():
    p = get_pair("neox")
    hf_ssd.disable()
    try:
        hf_ssd.enable(p.target)
        ids = prompt(5, seed=13)
        with torch.no_grad():
            out = p.target.generate(ids, assistant_model=p.related, ssd=True, max_new_tokens=6, pad_token_id=PAD,
                                    ssd_budget=4)
            assert torch.equal(out, plain_generate(p.target, ids, max_new_tokens=6))
            other = get_pair("llama").target
            with pytest.raises(ValueError, match="model_kwargs"):
                other.generate(ids, ssd=True, max_new_tokens=3, pad_token_id=PAD)
    finally:
        del p.target.generate
        hf_ssd.enable()
