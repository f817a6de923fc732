"""Reliability: bad values never become tokens, interrupts and faults leave workers usable, inputs SSD cannot run
exactly are refused with an error that names the option, and what is accepted equals plain generate()."""
from __future__ import annotations

import copy
import json
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteriaList

import hf_ssd
from hf_ssd.config import MAX_BUDGET, SSDConfig
from hf_ssd.draft.saguaro import SaguaroDrafter
from hf_ssd.runtime import processing
from hf_ssd.runtime.kv import position_limit
from hf_ssd.testing import PAD, VOCAB, InterruptOnCall, get_pair, noisy_copy, plain_generate, prompt
from hf_ssd.workers.thread import live_worker_threads

# Every performance option set: a fixed plan (no start-up measurement), so the tests are quick and deterministic.
FIXED = dict(ssd_mode="ssd", ssd_num_draft_tokens=3, ssd_budget=6, ssd_draft_quantize=None, do_sample=False,
             pad_token_id=PAD)


@pytest.fixture(scope="module")
def llm():
    return get_pair("llama")


def runtime_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def ssd(p, ids, draft=None, **kw):
    kw = {**FIXED, **kw}
    with torch.no_grad():
        return p.target.generate(ids, assistant_model=p.related if draft is None else draft, ssd=True, **kw)


KEPT: list = []  # DraftProcess handles a fixture keeps alive on purpose


def no_leaks() -> None:
    assert live_worker_threads() == []
    kept = {w.process.pid for w in KEPT if not w.closed}
    assert [c for c in multiprocessing.active_children() if c.name.startswith("hf-ssd") and c.pid not in kept] == []


# ---- 1. NaN / inf never become tokens ---------------------------------------------------------------------------
def test_nan_draft_is_a_draft_failure_and_tokens_follow_the_target(llm):
    draft = copy.deepcopy(llm.related)
    with torch.no_grad():
        for param in draft.parameters():
            param.fill_(float("nan"))
    rows, P = 300, 6
    ids = prompt(P, seed=3).repeat(rows, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ssd(llm, ids, draft, ssd_worker="inline", do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=1, generator=torch.Generator().manual_seed(0))
    messages = runtime_warnings(caught)
    assert any("failed" in m and "probability tensor contains either `inf`, `nan` or element < 0" in m
               for m in messages), messages
    first = out[:, P]
    with torch.no_grad():
        p = torch.softmax(llm.target(ids[:1]).logits[0, -1].double(), dim=-1)
    counts = torch.bincount(first, minlength=VOCAB).double()
    expected = rows * p
    # Before the fix every row drew the last vocabulary id.
    last = VOCAB - 1
    assert counts[last] <= expected[last] + 4 * (expected[last] * (1 - p[last])).sqrt() + 2
    # Chi-square over the tokens expected >= 5 times, the rest pooled: far below what a wrong law gives.
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(big.sum())
    assert chi2 < dof + 6 * dof**0.5 + 10, (chi2, dof)
    assert 0.5 * float((counts / rows - p).abs().sum()) < 0.3


class InfAt(LogitsProcessor):
    """Sets one logit to +inf (a numerically broken target)."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 5] = float("inf")
        return scores


def test_inf_target_logit_raises_like_plain(llm):
    ids = prompt(6, seed=4)
    kw = dict(max_new_tokens=4, do_sample=True, logits_processor=LogitsProcessorList([InfAt()]))
    with pytest.raises(RuntimeError, match=r"probability tensor contains either `inf`, `nan` or element < 0"):
        plain_generate(llm.target, ids, **kw)
    for worker in ("inline", "thread"):
        with pytest.raises(RuntimeError, match=r"probability tensor contains either `inf`, `nan` or element < 0"):
            ssd(llm, ids, ssd_worker=worker, ssd_trust_processors=True, **kw)
    no_leaks()
    # Greedy decoding never checks (plain's argmax takes the inf): SSD's greedy output is still plain's.
    kw["do_sample"] = False
    assert torch.equal(ssd(llm, ids, ssd_trust_processors=True, **kw), plain_generate(llm.target, ids, **kw))


def test_sample_refuses_bad_probabilities():
    from hf_ssd.core.sampling import sample

    for bad in (float("nan"), float("inf"), -0.1):
        probs = torch.full((2, 8), 0.125)
        probs[1, 3] = bad
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            sample(probs)


# ---- 2. Ctrl-C, kept DraftProcess, threads sharing one ------------------------------------------------------------
@pytest.fixture(scope="module")
def kept(llm):
    with hf_ssd.DraftProcess(llm.related) as worker:
        KEPT.append(worker)
        yield worker


def test_kept_process_survives_interrupt_in_stopping_criterion(llm, kept):
    ids = prompt(8, seed=5)
    ref = plain_generate(llm.target, ids, max_new_tokens=12)
    with pytest.raises(KeyboardInterrupt):
        ssd(llm, ids, ssd_worker=kept, max_new_tokens=30, stopping_criteria=StoppingCriteriaList([InterruptOnCall(3)]))
    for _ in range(2):
        assert torch.equal(ssd(llm, ids, ssd_worker=kept, max_new_tokens=12), ref)
    assert kept.process.is_alive()


class ConnProxy:
    """Wraps the parent's end of the pipe; `on_poll` / `on_send` run on the n-th call."""

    def __init__(self, conn, poll_at=None, send_at=None):
        self.conn, self.poll_at, self.send_at = conn, poll_at, send_at
        self.polls = self.sends = 0

    def poll(self, *args):
        self.polls += 1
        if self.polls == self.poll_at:
            self.conn.poll(30)  # the answer is on its way; Ctrl-C lands while we wait for it
            raise KeyboardInterrupt
        return self.conn.poll(*args)

    def send(self, msg):
        self.sends += 1
        if self.sends == self.send_at:
            # Half a message: the header promises more bytes than arrive, then Ctrl-C.
            self.conn._send(struct.pack("!i", 4096) + b"\x80\x05partial")
            raise KeyboardInterrupt
        return self.conn.send(msg)

    def __getattr__(self, name):
        return getattr(self.conn, name)


@pytest.mark.parametrize("poll_at", [2, 4])
def test_kept_process_drains_answers_of_an_interrupted_call(llm, kept, poll_at):
    """Ctrl-C while waiting for the child's answer used to shift every later answer by one request
    (AttributeError: 'NoneType' object has no attribute 'tokens' in the next generate())."""
    ids = prompt(8, seed=6)
    ref = plain_generate(llm.target, ids, max_new_tokens=12)
    real = kept.conn
    kept.conn = ConnProxy(real, poll_at=poll_at)
    try:
        with pytest.raises(KeyboardInterrupt):
            ssd(llm, ids, ssd_worker=kept, max_new_tokens=30)
    finally:
        kept.conn = real
    restarts = kept.restarts
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = ssd(llm, ids, ssd_worker=kept, max_new_tokens=12, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert runtime_warnings(caught) == [] and out.ssd_stats["worker"] == "process"
    assert kept.restarts == restarts  # drained, not restarted


def test_kept_process_restarts_after_interrupt_mid_message(llm, kept):
    ids = prompt(8, seed=7)
    ref = plain_generate(llm.target, ids, max_new_tokens=12)
    real = kept.conn
    kept.conn = ConnProxy(real, send_at=3)
    restarts = kept.restarts
    try:
        with pytest.raises(KeyboardInterrupt):
            ssd(llm, ids, ssd_worker=kept, max_new_tokens=30)
    finally:
        if kept.conn is not real and isinstance(kept.conn, ConnProxy):
            kept.conn = real
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ssd(llm, ids, ssd_worker=kept, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert runtime_warnings(caught) == [] and out.ssd_stats["cache_lookups"] > 0
    assert kept.restarts == restarts + 1 and kept.process.is_alive()


def test_kept_process_child_ignores_sigint(llm, kept):
    """A terminal's Ctrl-C reaches the whole process group; the child leaves the decision to the parent."""
    os.kill(kept.process.pid, signal.SIGINT)
    time.sleep(0.5)
    assert kept.process.is_alive()
    ids = prompt(7, seed=8)
    assert torch.equal(ssd(llm, ids, ssd_worker=kept, max_new_tokens=10),
                       plain_generate(llm.target, ids, max_new_tokens=10))


def test_two_threads_share_one_draft_process(llm, kept):
    prompts = [prompt(6 + i, seed=20 + i) for i in range(4)]
    refs = [plain_generate(llm.target, ids, max_new_tokens=14) for ids in prompts]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for j in (i, i + 2):
                results[j] = ssd(llm, prompts[j], ssd_worker=kept, max_new_tokens=14)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    assert runtime_warnings(caught) == []
    for j, ref in enumerate(refs):
        assert torch.equal(results[j], ref), j


@pytest.mark.parametrize("worker", ["thread", "inline"])
def test_interrupt_then_same_call_equals_plain(llm, worker):
    ids = prompt(8, seed=9).repeat(2, 1)
    ref = plain_generate(llm.target, ids, max_new_tokens=12)
    with pytest.raises(KeyboardInterrupt):
        ssd(llm, ids, ssd_worker=worker, max_new_tokens=30, stopping_criteria=StoppingCriteriaList([InterruptOnCall(3)]))
    no_leaks()
    assert torch.equal(ssd(llm, ids, ssd_worker=worker, max_new_tokens=12), ref)


def test_closed_draft_process_says_so(llm):
    worker = hf_ssd.DraftProcess(llm.related)
    worker.close()
    with pytest.raises(ValueError, match="DraftProcess that was closed; create a new one"):
        ssd(llm, prompt(5), ssd_worker=worker, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="DraftProcess was closed; create a new one"):
        worker.alive()
    worker.close()  # closing twice is fine
    no_leaks()


def test_spawned_child_that_cannot_start_names_the_main_guard(tmp_path):
    """A script without `if __name__ == "__main__":` runs again in the spawned child, which then fails to start."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import hf_ssd
        from hf_ssd.testing import tiny_llama
        worker = hf_ssd.DraftProcess(tiny_llama(0), timeout_s=120)
        worker.close()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr, done.stderr[-2000:]


# ---- 3. absolute position embeddings ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_64():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  initializer_range=0.3, bos_token_id=1, eos_token_id=VOCAB - 1, pad_token_id=PAD)
    torch.manual_seed(0)
    target = transformers.GPT2LMHeadModel(cfg).eval()
    return target, noisy_copy(target, 0.05)


@pytest.mark.parametrize("prompt_len,new", [(63, 1), (58, 6), (40, 24)])
@pytest.mark.parametrize("K", [4, 8])
@pytest.mark.parametrize("mode", ["ssd", "sync"])
def test_absolute_positions_up_to_the_last_one(gpt2_64, prompt_len, new, K, mode):
    target, draft = gpt2_64
    ids = prompt(prompt_len, seed=prompt_len)
    ref = plain_generate(target, ids, max_new_tokens=new)
    kw = {**FIXED, "ssd_mode": mode, "ssd_num_draft_tokens": K, "ssd_worker": "inline"}
    if mode == "sync":
        kw.pop("ssd_budget")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = target.generate(ids, assistant_model=draft, ssd=True, max_new_tokens=new, **kw)
    assert torch.equal(out, ref)
    assert runtime_warnings(caught) == []


def test_absolute_positions_default_options(gpt2_64):
    target, draft = gpt2_64
    ids = prompt(58, seed=58)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = target.generate(ids, assistant_model=draft, ssd=True, max_new_tokens=6, do_sample=False,
                                  pad_token_id=PAD)
    assert torch.equal(out, plain_generate(target, ids, max_new_tokens=6))
    assert runtime_warnings(caught) == []


def test_position_limit_only_for_position_tables(gpt2_64, llm):
    assert position_limit(gpt2_64[0]) == 64
    assert position_limit(llm.target) is None  # rotary: never clamped
    assert position_limit(get_pair("neox").target) is None


# ---- 4. a draft whose forward raises, default options (the start-up measurement runs it) -----------------------
def test_broken_draft_forward_with_default_budget(llm):
    draft = copy.deepcopy(llm.related)

    def broken(*args, **kwargs):
        raise RuntimeError("draft forward exploded")

    draft.forward = broken
    ids = prompt(6, seed=10)
    ref = plain_generate(llm.target, ids, max_new_tokens=8)
    for kw in (dict(), dict(ssd_mode="ssd")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                out = llm.target.generate(ids, assistant_model=draft, ssd=True, max_new_tokens=8, do_sample=False,
                                          pad_token_id=PAD, return_dict_in_generate=True, **kw)
        assert torch.equal(out.sequences, ref)
        assert any("draft forward exploded" in m for m in runtime_warnings(caught))
        assert out.ssd_stats["fallback_reason"] is not None


# ---- 5. budget caps ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [MAX_BUDGET + 1, 10**5, 10**9])
def test_huge_budget_refused(llm, budget):
    with pytest.raises(ValueError, match=rf"ssd_budget={budget} is invalid: at most {MAX_BUDGET}"):
        ssd(llm, prompt(5), ssd_budget=budget, max_new_tokens=4)


def test_largest_budget_capped_by_vocabulary(llm):
    ids = prompt(6, seed=11)
    start = time.perf_counter()
    out = ssd(llm, ids, ssd_budget=MAX_BUDGET, ssd_num_draft_tokens=4, ssd_worker="inline", max_new_tokens=12,
              return_dict_in_generate=True)
    assert time.perf_counter() - start < 30
    assert torch.equal(out.sequences, plain_generate(llm.target, ids, max_new_tokens=12))
    assert out.ssd_stats["budget"] == 5 * (VOCAB - 1) + 1


# ---- 6. refuse what SSD cannot run exactly, naming the option -----------------------------------------------------
@pytest.mark.parametrize("kw,error,match", [
    (dict(penalty_alpha=0.6, top_k=4), ValueError, "penalty_alpha=0.6 .contrastive search. cannot be combined"),
    (dict(dola_layers="high"), ValueError, "dola_layers='high' .DoLa decoding. cannot be combined"),
    (dict(attention_mask=torch.ones(1, 3, dtype=torch.long)), ValueError,
     r"attention_mask has shape \(1, 3\) but input_ids has shape \(1, 5\)"),
    (dict(ssd_downweight="0.5"), TypeError, "ssd_downweight='0.5' is invalid"),
    (dict(ssd_backup_batch_threshold=float("nan")), TypeError, "ssd_backup_batch_threshold=nan is invalid"),
    (dict(ssd_num_draft_tokens=2.0), TypeError, r"ssd_num_draft_tokens=2.0 is invalid: use an integer"),
    (dict(ssd_budget=True), TypeError, "ssd_budget=True is invalid"),
    (dict(ssd_alpha=float("nan")), ValueError, "ssd_alpha=nan is invalid"),
    (dict(ssd_power_r=float("inf")), ValueError, "ssd_power_r=inf is invalid"),
    (dict(ssd_draft_temperature="hot"), TypeError, "ssd_draft_temperature='hot' is invalid"),
    (dict(ssd_fanout=3), TypeError, "ssd_fanout=3 is invalid"),
    (dict(ssd_trust_processors="yes"), TypeError, "ssd_trust_processors='yes' is invalid"),
    (dict(ssd_draft_device="nowhere"), ValueError, "ssd_draft_device='nowhere' is invalid"),
    (dict(ssd_mode="sync", ssd_worker="process"), ValueError, "ssd_worker applies to ssd_mode='ssd'"),
    (dict(ssd_mode="sync", ssd_worker="thread"), ValueError, "ssd_worker applies to ssd_mode='ssd'"),
])
def test_refused_with_the_option_named(llm, kw, error, match):
    with pytest.raises(error, match=match):
        ssd(llm, prompt(5), max_new_tokens=4, **kw)


def test_meta_draft_device_refused_before_moving(llm):
    draft = copy.deepcopy(llm.related)
    with pytest.raises(ValueError, match="ssd_draft_device='meta' is invalid"):
        ssd(llm, prompt(5), draft, max_new_tokens=4, ssd_draft_device="meta")
    assert all(p.device.type == "cpu" for p in draft.parameters())
    ids = prompt(6, seed=12)
    assert torch.equal(ssd(llm, ids, draft, max_new_tokens=6, ssd_draft_device="cpu"),
                       plain_generate(llm.target, ids, max_new_tokens=6))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_unavailable_draft_device_refused_before_moving(llm):
    draft = copy.deepcopy(llm.related)
    with pytest.raises(ValueError, match="ssd_draft_device='cuda' is invalid: CUDA is not available"):
        ssd(llm, prompt(5), draft, max_new_tokens=4, ssd_draft_device="cuda")
    assert all(p.device.type == "cpu" for p in draft.parameters())


@pytest.mark.parametrize("bad", ["foo", 3, torch.zeros(2)])
def test_assistant_model_must_be_a_model(llm, bad):
    with pytest.raises(TypeError, match="assistant_model must be a transformers model"):
        llm.target.generate(prompt(5), assistant_model=bad, ssd=True, max_new_tokens=3, pad_token_id=PAD)


@pytest.mark.parametrize("content,match", [("{not json", "is not valid JSON"),
                                           (json.dumps({"budget": "many"}), "ssd_budget='many' is invalid")])
def test_malformed_ssd_config_beside_the_weights_names_the_file(llm, tmp_path, content, match):
    path = tmp_path / "ssd_config.json"
    path.write_text(content)
    draft = copy.deepcopy(llm.related)
    draft.config._name_or_path = str(tmp_path)
    draft.name_or_path = str(tmp_path)
    with pytest.raises(ValueError, match=match) as info:
        llm.target.generate(prompt(5), assistant_model=draft, ssd=True, max_new_tokens=3, pad_token_id=PAD)
    assert str(path) in str(info.value)


def test_valid_numbers_of_other_types_are_normalised():
    import numpy as np

    cfg = SSDConfig(num_draft_tokens=np.int64(3), budget=np.int32(5), downweight=1, alpha=np.float32(0.5),
                    fanout=(1, 1, 1, 2))
    assert cfg.num_draft_tokens == 3 and type(cfg.num_draft_tokens) is int and type(cfg.budget) is int
    assert type(cfg.downweight) is float and type(cfg.alpha) is float and cfg.fanout == [1, 1, 1, 2]
    assert SSDConfig.from_dict(json.loads(cfg.to_json_string())) == cfg
    assert SSDConfig(mode="sync", worker="inline").worker == "inline"


# ---- 7. stateful custom processors ----------------------------------------------------------------------------------
def _custom_processor_class():
    class BanToken(LogitsProcessor):  # a fresh class per test: "warn once" is per class and per process
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, 7] = -float("inf")
            return scores

    return BanToken


def test_custom_processor_warns_once(llm):
    cls = _custom_processor_class()
    ids = prompt(6, seed=13)
    procs = LogitsProcessorList([cls()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ssd(llm, ids, max_new_tokens=8, logits_processor=procs)
        second = ssd(llm, ids, max_new_tokens=8, logits_processor=LogitsProcessorList([cls()]))
    messages = [m for m in runtime_warnings(caught) if "custom logits processor" in m]
    assert len(messages) == 1 and "BanToken" in messages[0] and "ssd_trust_processors=True" in messages[0]
    ref = plain_generate(llm.target, ids, max_new_tokens=8, logits_processor=procs)
    assert torch.equal(first, ref) and torch.equal(second, ref)


def test_trusted_custom_processor_does_not_warn(llm):
    cls = _custom_processor_class()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ssd(llm, prompt(6), max_new_tokens=4, logits_processor=LogitsProcessorList([cls()]),
            ssd_trust_processors=True)
    assert runtime_warnings(caught) == []
    assert cls not in processing._WARNED


def test_builtin_processors_never_warn(llm):
    ids = prompt(6, seed=14)
    kw = dict(max_new_tokens=8, repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=3,
              bad_words_ids=[[5]], suppress_tokens=[9], sequence_bias={(4,): -2.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ssd(llm, ids, **kw)
        ssd(llm, ids, max_new_tokens=4, do_sample=True, top_k=10, top_p=0.9, temperature=0.7, min_p=0.01)
    assert runtime_warnings(caught) == []
    assert torch.equal(out, plain_generate(llm.target, ids, **kw))


# ---- 8. smaller points -----------------------------------------------------------------------------------------
def test_thread_worker_system_exit_is_a_draft_failure(llm, monkeypatch):
    original = SaguaroDrafter.begin
    calls = {"n": 0}

    def exits(self, spec):
        calls["n"] += 1
        if calls["n"] == 2:
            sys.exit(3)
        return original(self, spec)

    monkeypatch.setattr(SaguaroDrafter, "begin", exits)
    ids = prompt(7, seed=15)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ssd(llm, ids, ssd_worker="thread", max_new_tokens=16)
    assert torch.equal(out, plain_generate(llm.target, ids, max_new_tokens=16))
    assert any("called exit (3)" in m for m in runtime_warnings(caught))
    no_leaks()


def test_sync_mode_with_inline_or_auto_worker_is_fine(llm):
    ids = prompt(6, seed=16)
    ref = plain_generate(llm.target, ids, max_new_tokens=6)
    for worker in ("auto", "inline"):
        assert torch.equal(ssd(llm, ids, ssd_mode="sync", ssd_worker=worker, max_new_tokens=6), ref)
