"""Inputs SSD cannot handle exactly are refused with an error that says what to change."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import TextIteratorStreamer

from hf_ssd.testing import PAD, get_pair, left_pad, prompt, word_tokenizer


@pytest.fixture(scope="module")
def llm():
    return get_pair("llama")


def gen(p, draft="related", ids=None, **kw):
    ids = prompt(5, seed=1) if ids is None else ids
    kw.setdefault("max_new_tokens", 4)
    kw.setdefault("pad_token_id", PAD)
    kw.setdefault("ssd_budget", 4)
    d = getattr(p, draft) if isinstance(draft, str) else draft
    with torch.no_grad():
        return p.target.generate(ids, assistant_model=d, ssd=True, **kw)


def test_ssd_without_assistant_model(llm):
    with pytest.raises(ValueError, match="ssd=True needs a draft model"):
        llm.target.generate(prompt(5), ssd=True, max_new_tokens=3, pad_token_id=PAD)


def test_different_vocab_sizes(llm):
    cfg = copy.deepcopy(llm.target.config)
    cfg.vocab_size = llm.target.config.vocab_size + 8
    other = transformers.LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"vocabulary has 96 tokens but the draft's has 104"):
        gen(llm, other)


def test_different_eos(llm):
    cfg = copy.deepcopy(llm.target.config)
    cfg.eos_token_id = 3
    other = transformers.LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="eos_token_id"):
        gen(llm, other)


def test_num_beams(llm):
    with pytest.raises(ValueError, match="num_beams=2 cannot be combined with ssd=True"):
        gen(llm, num_beams=2)


def test_num_return_sequences(llm):
    with pytest.raises(ValueError, match=r"num_return_sequences=2 is not supported with ssd=True.*repeat the prompt"):
        gen(llm, num_return_sequences=2, do_sample=True)


def test_static_cache(llm):
    with pytest.raises(ValueError, match=r"cache_implementation='static' is not supported with ssd=True"):
        gen(llm, cache_implementation="static")


def test_past_key_values_and_inputs_embeds(llm):
    with pytest.raises(ValueError, match="past_key_values .* cannot be passed with ssd=True"):
        gen(llm, past_key_values=transformers.DynamicCache())
    emb = llm.target.get_input_embeddings()(prompt(5))
    with pytest.raises(ValueError, match="inputs_embeds is not supported with ssd=True"):
        with torch.no_grad():
            llm.target.generate(inputs_embeds=emb, assistant_model=llm.related, ssd=True, max_new_tokens=3,
                                pad_token_id=PAD, ssd_budget=4)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_stateful_model(llm, role):
    model = copy.deepcopy(llm.target if role == "target" else llm.related)
    model._is_stateful = True
    target, draft = (model, llm.related) if role == "target" else (llm.target, model)
    with pytest.raises(ValueError, match=r"is stateful \(recurrent state cannot be rolled back"):
        with torch.no_grad():
            target.generate(prompt(5), assistant_model=draft, ssd=True, max_new_tokens=3, pad_token_id=PAD)


def test_unsupported_layer_types(llm):
    model = copy.deepcopy(get_pair("gemma3").target)
    model.config.layer_types = ["sliding_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layers of type \['linear_attention'\].*cannot be rolled back"):
        with torch.no_grad():
            model.generate(prompt(5), assistant_model=model, ssd=True, max_new_tokens=3, pad_token_id=PAD)


def test_guidance_scale(llm):
    with pytest.raises(ValueError, match="guidance_scale .* cannot be verified speculatively"):
        gen(llm, guidance_scale=2.0)


def test_encoder_decoder():
    cfg = transformers.T5Config(vocab_size=96, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    t5 = transformers.T5ForConditionalGeneration(cfg).eval()
    with pytest.raises(ValueError, match="encoder-decoder model; ssd=True supports decoder-only"):
        with torch.no_grad():
            t5.generate(prompt(5), assistant_model=t5, ssd=True, max_new_tokens=3)
    # and an encoder-decoder draft for a decoder-only target
    p = get_pair("llama")
    cfg2 = copy.deepcopy(cfg)
    cfg2.eos_token_id = p.target.config.eos_token_id
    with pytest.raises(ValueError, match="draft \\(assistant_model\\) is an encoder-decoder"):
        gen(p, transformers.T5ForConditionalGeneration(cfg2).eval())


def test_misspelt_ssd_kwarg(llm):
    with pytest.raises(TypeError, match=r"unknown SSD option `ssd_num_draft_token`.*ssd_num_draft_tokens"):
        gen(llm, ssd_num_draft_token=3)
    with pytest.raises(TypeError, match="unknown SSD option `ssd_version`"):
        gen(llm, ssd_version=1)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(ssd_mode="fast"), r"ssd_mode='fast' is invalid: choose one of \('auto', 'ssd', 'sync'\)"),
        (dict(ssd_num_draft_tokens=0), "ssd_num_draft_tokens=0 is invalid"),
        (dict(ssd_num_draft_tokens=2.5), "ssd_num_draft_tokens=2.5 is invalid"),
        (dict(ssd_budget=0), "ssd_budget=0 is invalid"),
        (dict(ssd_num_draft_tokens=3, ssd_fanout=[1, 1]), r"ssd_fanout=\[1, 1\] is invalid: give num_draft_tokens\+1 = 4"),
        (dict(ssd_num_draft_tokens=1, ssd_fanout=[1, -1]), "ssd_fanout=.* is invalid"),
        (dict(ssd_downweight=1.5), r"ssd_downweight=1.5 is invalid: Saguaro's C must lie in \[0, 1\]"),
        (dict(ssd_downweight=-0.1), "ssd_downweight=-0.1 is invalid"),
        (dict(ssd_backup="random"), r"ssd_backup='random' is invalid: choose one of"),
        (dict(ssd_draft_temperature=0.0), "ssd_draft_temperature=0.0 is invalid"),
        (dict(ssd_alpha=1.0), "ssd_alpha=1.0 is invalid"),
        (dict(ssd_alpha_prior=0.0), r"ssd_alpha_prior=0.0 is invalid: use a float in \(0, 1\]"),
        (dict(ssd_worker="gpu"), "ssd_worker='gpu' is invalid"),
        (dict(ssd_ngram_max=0), "ssd_ngram_max=0 is invalid"),
    ],
)
def test_invalid_ssd_values(llm, kw, match):
    with pytest.raises(ValueError, match=match):
        gen(llm, **kw)


def test_ssd_kwargs_without_ssd_true(llm):
    with pytest.raises(TypeError, match=r"SSD options \['ssd_num_draft_tokens'\] were given without ssd=True"):
        llm.target.generate(prompt(5), ssd_num_draft_tokens=3, max_new_tokens=3, pad_token_id=PAD)
    with pytest.raises(TypeError, match="without ssd=True"):
        llm.target.generate(prompt(5), ssd=False, ssd_mode="sync", max_new_tokens=3, pad_token_id=PAD)
    with pytest.raises(TypeError, match="without ssd=True"):
        llm.target.generate(prompt(5), ssd_config=hf_ssd_config(), max_new_tokens=3, pad_token_id=PAD)


def hf_ssd_config():
    from hf_ssd import SSDConfig

    return SSDConfig(num_draft_tokens=2)


def test_streamer_with_batch(llm):
    tok = word_tokenizer()
    ids, mask = left_pad([prompt(4, seed=1)[0], prompt(6, seed=2)[0]])
    with pytest.raises(ValueError, match="streamers take one sequence"):
        gen(llm, ids=ids, attention_mask=mask, streamer=TextIteratorStreamer(tok))


def test_custom_generate_with_ssd(llm):
    with pytest.raises(ValueError, match="drop custom_generate"):
        gen(llm, custom_generate=lambda *a, **k: None)


def test_stop_strings_need_tokenizer(llm):
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        gen(llm, stop_strings=["x"])


def test_tokenizer_vocab_mismatch(llm):
    a, b = word_tokenizer(), word_tokenizer(shift=1)
    with pytest.raises(ValueError, match="tokenizers have different vocabularies"):
        gen(llm, tokenizer=a, assistant_tokenizer=b)


def test_valid_config_still_runs(llm):
    """Guard for the tests above: the same call with valid values succeeds."""
    out = gen(llm, ssd_mode="sync", ssd_num_draft_tokens=2)
    assert out.shape == (1, 9)

