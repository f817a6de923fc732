"""The static (compilable) cache beyond SSD's in-process tree: synchronous SD's draft steps, the target's verify
(`ssd_compile_target`) and the process worker's tree, each exact against plain generate().

- greedy output equals plain generate() on every tiny architecture, with left padding and a row finishing early;
- with the static path (compile off) SD drafts exactly what the dynamic cache drafts (same rounds, acceptances);
- at T > 0 the static target draws what the dynamic target draws with the same seeds (same law);
- compiled (CPU inductor): identical output, zero graph breaks, no recompilation over 20+ rounds of a second call;
- the process worker builds the static, compiled tree in its own process and reports it.
"""
from __future__ import annotations

import pytest
import torch

import hf_ssd
from hf_ssd.runtime import static_kv, static_registry
from hf_ssd.testing import ARCHS, get_pair, left_pad, plain_generate, prompt, ssd_generate


@pytest.fixture
def eager(monkeypatch):
    """The static paths without torch.compile (fast; what every exactness property is about)."""
    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)


@pytest.fixture
def dynamo():
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    counters.clear()
    with inductor_config.patch(compile_threads=1):  # no worker pool: faster on a small machine
        yield counters


def _batch_with_early_eos(p, new: int):
    """Three left-padded rows; row 0 meets its EOS after 5 tokens, the others run on."""
    ids, mask = left_pad([prompt(11, seed=14)[0], prompt(5, seed=15)[0], prompt(1, seed=3)[0]])
    free = plain_generate(p.target, ids[:1], attention_mask=mask[:1], max_new_tokens=new)
    eos = int(free[0, ids.shape[1] + 4])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=new, eos_token_id=eos)
    return ids, mask, eos, ref


# ---- greedy identity, static paths eager ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_sync_sd_static_draft_identity(arch, eager):
    p = get_pair(arch)
    ids, mask, eos, ref = _batch_with_early_eos(p, 20)
    stats = []
    for compile_ in (False, True):
        out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos,
                           return_dict_in_generate=True, ssd_mode="sync", ssd_compile=compile_)
        assert torch.equal(out.sequences, ref), (out.sequences.tolist(), ref.tolist())
        stats.append(out.ssd_stats)
    dyn, sta = stats
    assert sta["draft_static"] and not dyn["draft_static"] and sta["fallback_reason"] is None
    for key in ("rounds", "accept_hist", "per_row"):  # the same drafts as the dynamic cache
        assert sta[key] == dyn[key], key


@pytest.mark.parametrize("mode,worker", [("sync", "inline"), ("ssd", "inline"), ("ssd", "thread")])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_target_identity(arch, mode, worker, eager):
    p = get_pair(arch)
    ids, mask, eos, ref = _batch_with_early_eos(p, 20)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos,
                       return_dict_in_generate=True, ssd_mode=mode, ssd_worker=worker, ssd_compile_target=True,
                       ssd_compile=True)
    assert torch.equal(out.sequences, ref), (out.sequences.tolist(), ref.tolist())
    assert out.ssd_stats["fallback_reason"] is None


def test_static_target_samples_what_dynamic_target_samples(eager):
    """Same seeds, T = 0.7, top-k: the static target's verify gives the dynamic one's tokens (its logits are the same
    model's), so its output law is the one test_sampling_exact checks for the dynamic path. The backup is fixed: the
    automatic one decides from measured times, which differ between the two targets."""
    p = get_pair("llama")
    ids, mask = left_pad([prompt(7, seed=31)[0], prompt(3, seed=32)[0]])
    outs = []
    for static in (False, True):
        for mode in ("sync", "ssd"):
            torch.manual_seed(123)
            outs.append(ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=24, do_sample=True,
                                     temperature=0.7, top_k=20, ssd_mode=mode, ssd_worker="inline",
                                     ssd_compile_target=static, ssd_backup="jit"))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_compile_target_option_is_validated():
    with pytest.raises(ValueError, match="compile_target"):
        hf_ssd.SSDConfig(compile_target="yes")


# ---- compiled -----------------------------------------------------------------------------------------------------------
def test_compiled_sd_and_target_no_breaks_no_recompiles(dynamo):
    """Compiled SD draft steps (widths 1 and 2) and a compiled verify block (K + 1): identical output; the second
    generate() of 20+ rounds builds no graph and recompiles nothing."""
    import torch._dynamo

    counters = dynamo
    p = get_pair("qwen2")
    ids, mask = left_pad([prompt(9, seed=20)[0]])
    new = 60
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=new)
    kw = dict(attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True, ssd_mode="sync",
              ssd_num_draft_tokens=3, ssd_compile=True, ssd_compile_target=True)
    first = ssd_generate(p.target, p.related, ids, **kw)
    assert torch.equal(first.sequences, ref)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = ssd_generate(p.target, p.related, ids, **kw)
    st = out.ssd_stats
    assert torch.equal(out.sequences, ref)
    assert st["draft_compiled"] and st["fallback_reason"] is None and st["rounds"] >= 20
    assert counters["stats"]["unique_graphs"] == graphs > 0
    assert not counters["graph_break"]
    entries = static_registry.registry_entries(p.target) + static_registry.registry_entries(p.related)
    assert {e.model_ref() for e in entries} == {p.target, p.related}
    assert all(e.compile_failed is None for e in entries)  # a failed compile runs eagerly: it must not hide here
    # the draft's graphs skip dynamo's module guards (static_registry.compile_kwargs); the target's keep them all
    # (other tests' direct StaticCachedModel entries of the same models are guarded: only compiled drafts are not)
    assert all(e.guard_modules for e in entries if e.model_ref() is p.target)
    assert any(not e.guard_modules and e.compiled_widths for e in entries if e.model_ref() is p.related)


def test_process_worker_builds_the_compiled_tree():
    """ssd_compile with the process worker: the child builds the static cache and compiles it (reported back);
    a kept DraftProcess keeps its graphs for the next generation; output identical to plain generate()."""
    p = get_pair("llama")
    ids, mask = left_pad([prompt(9, seed=20)[0], prompt(4, seed=21)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24)
    with hf_ssd.DraftProcess(p.related) as worker:
        stats = []
        for _ in range(2):
            out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=24,
                               return_dict_in_generate=True, ssd_worker=worker, ssd_compile=True,
                               ssd_num_draft_tokens=3, ssd_budget=4)
            assert torch.equal(out.sequences, ref)
            stats.append(out.ssd_stats)
    for st in stats:
        assert st["worker"] == "process" and st["draft_static"] and st["draft_compiled"]
        assert st["fallback_reason"] is None
    assert stats[0]["draft_compile_s"] > 0 and stats[1]["draft_compile_s"] == 0.0  # compiled once per process


@pytest.mark.parametrize("mode", ["sync", "ssd"])
def test_static_buffers_survive_grad_modes_and_threads(mode, eager):
    """Buffers first written under inference_mode serve later generations under no_grad, and in a worker thread
    (which does not inherit the caller's mode): every static buffer update runs in inference mode."""
    p = get_pair("llama")
    ids, mask = left_pad([prompt(9, seed=20)[0], prompt(4, seed=21)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=16)
    worker = "inline" if mode == "sync" else "thread"
    for grad_mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with grad_mode():
            out = p.target.generate(ids, attention_mask=mask, assistant_model=p.related, ssd=True, ssd_mode=mode,
                                    ssd_worker=worker, ssd_num_draft_tokens=3, ssd_budget=4, ssd_draft_quantize=None,
                                    ssd_compile=True, ssd_compile_target=True, max_new_tokens=16, do_sample=False,
                                    pad_token_id=0, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.ssd_stats["fallback_reason"] is None and out.ssd_stats["draft_static"]


def test_sync_static_draft_has_room_for_its_holes(eager):
    """Synchronous SD on the static cache leaves one hole per round whose last draft is rejected; a prompt that
    fills the cache's bucket to the brim (max_length + 2(K+1) = 255 slots of 256) must still run without a fallback."""
    p = get_pair("llama")
    K, new = 4, 60
    ids, mask = left_pad([prompt(256 - new - 2 * (K + 1) - 1, seed=40)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=new)
    out = ssd_generate(p.target, p.shallow, ids, attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True,
                       ssd_mode="sync", ssd_num_draft_tokens=K, ssd_compile=True)
    st = out.ssd_stats
    assert torch.equal(out.sequences, ref)
    assert st["draft_static"] and st["fallback_reason"] is None
    assert st["accepted"] < st["drafted"]  # rejections happened, so holes did
