"""The static, fixed-shape, sync-free (and compiled) draft side (`ssd_compile`): runtime.static_kv +
draft.static_saguaro.

- the static cache gives CachedModel's logits (holes, rewinds, dead rows) and the static tree masks are
  `tree_attend`'s, element by element;
- greedy output equals plain generate() on every tiny architecture (static cache, compile off), with left padding
  and rows finishing early, and drafts exactly what the dynamic cache drafts (same rounds, same hits);
- at T > 0 it draws exactly what the dynamic drafter draws with the same seeds and the same tree width: same
  tokens, same q (so its output law is the dynamic path's, which test_sampling_exact checks);
- nothing on the hot path (glue, fork, K tree steps, lookup) reads a tensor on the host;
- compiled (CPU inductor): identical output, zero graph breaks, no recompilation from round to round nor across
  generate() calls, warm-up reported and reused.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import hf_ssd
import hf_ssd.draft.saguaro as saguaro_mod
from hf_ssd.config import SSDConfig
from hf_ssd.core.tree import fork
from hf_ssd.core.types import Forks, Outcome, Verdict
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.saguaro import SaguaroDrafter
from hf_ssd.draft import static_saguaro
from hf_ssd.draft.static_saguaro import StaticSaguaroDrafter
from hf_ssd.runtime import static_kv, static_registry
from hf_ssd.runtime.kv import CachedModel
from hf_ssd.runtime.slot_step import slot_allowed
from hf_ssd.runtime.static_kv import StaticCachedModel
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.testing import ARCHS, VOCAB, get_pair, left_pad, plain_generate, prompt, ssd_generate

try:
    from hf_ssd.testing import tree_attend_reference
except ImportError:  # older layout
    from hf_ssd.core.tree import tree_attend_reference

K, BUDGET = 3, 4  # glue and tree steps both 4 tokens wide: one compiled graph per (model, batch)
# backup "jit": the "auto" policy weighs measured times, so two runs could pick different backups
STATIC = dict(ssd_compile=True, ssd_num_draft_tokens=K, ssd_budget=BUDGET, ssd_worker="inline", ssd_backup="jit")


@pytest.fixture(autouse=True)
def glue_every_round(monkeypatch):
    """These tests compare the static drafter with the dynamic one draft for draft: the static path's carrying the
    tree over (which changes what is drafted, exactly) is tested in test_tree_reuse.py."""
    monkeypatch.setattr(static_saguaro, "REUSE_TREE", False)


@pytest.fixture
def eager(monkeypatch):
    """The static path without torch.compile (fast; what every exactness property is about)."""
    monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)


def _batch():
    """Three left-padded rows of different lengths (one of length 1: no prefill)."""
    return left_pad([prompt(11, seed=14)[0], prompt(5, seed=15)[0], prompt(1, seed=3)[0]])


# ---- the cache and the masks ------------------------------------------------------------------------------------------
@pytest.fixture(params=["views", "all slots"])
def slot_views(request, monkeypatch):
    """Forwards over views of 8, 16, 32 ... slots of a 64-slot cache (static_kv._slot_view), or over all 64. Records
    the slots each eager forward's mask spans."""
    views = request.param == "views"
    monkeypatch.setattr(static_kv, "SLOT_VIEWS", views)
    monkeypatch.setattr(static_kv, "VIEW_BUCKET", 8)
    spans, step = [], static_kv.slot_step

    def spy(model, cache, cache_kw, w, valid, *args, **kw):
        spans.append(valid.shape[1])
        return step(model, cache, cache_kw, w, valid, *args, **kw)

    monkeypatch.setattr(static_kv, "slot_step", spy)
    return views, spans


@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_matches_dynamic_cache(arch, slot_views):
    m = get_pair(arch).target
    ids, mask = _batch()
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    dyn, sta = CachedModel(m, 3), StaticCachedModel(m, 3, 64)

    def both(tokens, positions, valid=None):
        a, b = dyn.forward(tokens, positions, valid), sta.forward(tokens, positions, valid)
        keep = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool()
        torch.testing.assert_close(b[keep], a[keep], atol=2e-5, rtol=0)
        assert torch.equal(dyn.next_position(), sta.next_position())

    both(ids, pos, mask.bool())  # prefill with left-padding holes
    B = ids.shape[0]
    for rnd in range(3):
        nxt = dyn.next_position()
        both(torch.randint(2, 90, (B, 3)), nxt[:, None] + torch.arange(3))
        keep = torch.tensor([1, 3, 2]) - rnd % 2  # rewind each row to a different length
        dyn.invalidate(dyn.length - 3 + keep[: dyn.valid.shape[0]])
        sta.invalidate(sta.write_pointer() - 3 + keep[: dyn.valid.shape[0]])
        dyn.trim()
        sta.trim()
        if rnd == 1:  # row 0 finishes: a dead row of the static batch
            dyn.select_rows(torch.tensor([1, 2]))
            sta.select_rows(torch.tensor([1, 2]))
            B = 2
    assert sta.valid.shape == (2, 64)
    views, spans = slot_views
    assert sta.slot_model is not sta.model  # every tiny architecture runs packed attention, which reads the views
    assert spans == ([16, 16, 32, 32] if views else [64] * 4)  # 11 prompt slots, then 3 rounds of 3


@pytest.mark.parametrize("arch", ARCHS)
def test_unpadded_prefill_runs_causal_and_matches_the_masked_one(arch, monkeypatch):
    """An unpadded prefill of an empty cache passes no mask (SDPA's causal kernel: 1.5x faster on a 716-token
    prompt) for the listed full-attention families; its logits and the decode step after it equal the masked
    prefill's. A left-padded batch keeps the mask."""
    from hf_ssd.runtime.kv import CAUSAL_PREFILL_MODELS, attention_layout

    m = get_pair(arch).target
    expected = m.config.model_type in CAUSAL_PREFILL_MODELS and attention_layout(m) == (None, None)
    flags = []
    real = static_kv.slot_step
    monkeypatch.setattr(static_kv, "slot_step", lambda *a, **k: flags.append(k.get("causal", False)) or real(*a, **k))
    ids = prompt(12, seed=21)
    step = torch.randint(2, 90, (1, 2), generator=torch.Generator().manual_seed(4))
    out = {}
    for listed in (True, False):
        monkeypatch.setattr("hf_ssd.runtime.kv.CAUSAL_PREFILL_MODELS", CAUSAL_PREFILL_MODELS if listed else ())
        kv = StaticCachedModel(m, 1, 64)
        first = kv.forward(ids, torch.arange(12)[None], prefill=True)
        out[listed] = (first, kv.forward(step, torch.arange(12, 14)[None]))
        kv.release()
    assert flags == [expected, False, False, False]
    torch.testing.assert_close(out[True], out[False], atol=2e-5, rtol=0)
    flags.clear()
    ids, mask = _batch()
    kv = StaticCachedModel(m, 3, 64)
    kv.forward(ids, (mask.cumsum(1) - 1).clamp_min(0), mask.bool(), prefill=True)
    kv.release()
    kv = StaticCachedModel(m, 1, 64)  # positions that are not the slots' order (a context resumed mid-sequence)
    kv.forward(prompt(12, seed=21), torch.arange(5, 17)[None], prefill=True)
    kv.release()
    assert flags == [False, False]


@pytest.mark.parametrize("seed", range(6))
def test_static_tree_masks_equal_reference(seed):
    """The slot-space mask of tree step `step` is tree_attend's, row by row, with rows at different offsets."""
    g = torch.Generator().manual_seed(seed)
    B, L0 = 3, int(torch.randint(0, 9, (1,), generator=g))
    Kt, N = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
    past_valid = torch.rand(B, L0, generator=g) < 0.7
    n = torch.randint(0, Kt + 1, (B,), generator=g)
    glue_valid = torch.cat([torch.ones(B, 1, dtype=torch.bool), torch.arange(Kt)[None] < n[:, None]], 1)
    forks = Forks(torch.randint(0, 50, (B, N), generator=g),
                  torch.minimum(torch.randint(0, Kt + 1, (B, N), generator=g), n[:, None]),
                  torch.rand(B, N, generator=g) < 0.8)
    shift = torch.randint(0, 4, (B,), generator=g)  # row b's slots start `shift` holes later
    M = 4 + L0 + Kt + 1 + Kt * N + 5
    slot_ids = torch.arange(M)
    for step in range(1, Kt + 1):
        valid = torch.zeros(B, M, dtype=torch.bool)
        for b in range(B):
            s = int(shift[b])
            cols = torch.cat([past_valid[b], glue_valid[b]] + [forks.valid[b]] * step)
            valid[b, s:s + cols.numel()] = cols  # slots past the write pointer stay invalid (the invariant)
        glue = shift + L0
        allowed = slot_allowed(valid, glue[:, None] + forks.depth, torch.arange(N)[None].expand(B, N),
                               glue + Kt + 1, slot_ids, N)
        ref = tree_attend_reference(past_valid, glue_valid, forks, step)
        for b in range(B):
            s = int(shift[b])
            assert torch.equal(allowed[b, :, s:s + ref.shape[2]], ref[b])
            assert not allowed[b, :, :s].any() and not allowed[b, :, s + ref.shape[2]:].any()


def test_static_cache_full_is_a_clear_error():
    sta = StaticCachedModel(get_pair("llama").target, 1, 8)
    sta.forward(torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.arange(6)[None])
    with pytest.raises(RuntimeError, match="static draft cache is full"):
        sta.forward(torch.tensor([[5, 6, 7]]), torch.arange(6, 9)[None])


def test_draft_graphs_drop_module_guards_where_torch_can():
    """The draft's compiled steps skip dynamo's guards on the model's modules (a few percent of a small forward on
    CPU); the target's keep every guard. CUDA graphs stay on with the guard filter (mode and options cannot both be
    given to torch.compile). CPU graphs of both run with inductor's C++ wrapper."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    wrapper = static_registry.cpu_wrapper_options()  # CPU graphs only: their kernels called from C++
    assert wrapper == {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "size_asserts": False}
    assert static_registry.compile_kwargs(cpu) == {"fullgraph": True, "dynamic": False, "options": wrapper}
    assert static_registry.compile_kwargs(cuda) == {"fullgraph": True, "dynamic": False, "mode": "reduce-overhead"}
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    draft_cpu, draft_cuda = (static_registry.compile_kwargs(d, guard_modules=False) for d in (cpu, cuda))
    if skip is None:
        assert draft_cpu == static_registry.compile_kwargs(cpu)
        return
    assert draft_cpu["options"] == {**wrapper, "guard_filter_fn": skip} and "mode" not in draft_cpu
    assert draft_cuda["options"] == {"triton.cudagraphs": True, "guard_filter_fn": skip}
    # entries of the two kinds never serve each other
    from hf_ssd.testing import tiny_llama

    m = tiny_llama().eval()  # its own model: the shared pairs' registries are other tests' to check
    unguarded = StaticCachedModel(m, 1, 64, guard_modules=False).entry
    guarded = StaticCachedModel(m, 1, 64).entry
    assert unguarded is not guarded and not unguarded.guard_modules and guarded.guard_modules
    static_registry.release(unguarded)
    static_registry.release(guarded)
    assert StaticCachedModel(m, 1, 64, guard_modules=False).entry is unguarded


def test_compile_option_is_validated():
    assert SSDConfig(compile="auto").compile == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="ssd_compile"):
            SSDConfig(compile=bad)


# ---- greedy identity (static cache, compile off) ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_identity_static_eager(arch, eager):
    p = get_pair(arch)
    ids, mask = _batch()
    free = plain_generate(p.target, ids[:1], attention_mask=mask[:1], max_new_tokens=20)
    eos = int(free[0, ids.shape[1] + 4])  # row 0 stops early; the others run on (or stop where they meet it)
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos)
    for draft in (p.related, p.shallow):
        outs = []
        for compile_ in (False, True):
            out = ssd_generate(p.target, draft, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos,
                               return_dict_in_generate=True, **{**STATIC, "ssd_compile": compile_})
            assert torch.equal(out.sequences, ref), (out.sequences.tolist(), ref.tolist())
            outs.append(out.ssd_stats)
        dyn, sta = outs
        assert sta["draft_static"] and not dyn["draft_static"] and sta["fallback_reason"] is None
        # the same drafts: the same rounds, acceptances and cache hits as the dynamic cache
        for key in ("rounds", "accept_hist", "cache_hits", "backup_rounds", "per_row"):
            assert sta[key] == dyn[key], key


@pytest.mark.parametrize("K_", [1, 4])
def test_identity_static_eager_other_shapes(K_, eager):
    """K+1 != N (two widths), K = 1, fixed fan-out lists larger than the budget, the thread worker."""
    p = get_pair("llama")
    ids, mask = _batch()
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=16)
    fan = [3] * (K_ + 1)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=16, ssd_compile=True,
                       ssd_num_draft_tokens=K_, ssd_budget=2, ssd_fanout=fan, ssd_worker="thread",
                       return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.ssd_stats["draft_static"] and out.ssd_stats["fallback_reason"] is None


# ---- T > 0: the same draws as the dynamic drafter ---------------------------------------------------------------------
def _pair_of_drafters(model, B, greedy, downweight, warpers, seed, backup="jit"):
    config = SSDConfig(mode="ssd", num_draft_tokens=K, budget=BUDGET, downweight=downweight, backup=backup,
                       worker="inline", draft_quantize=None)
    out = []
    for static in (False, True):
        gen = None if greedy else torch.Generator().manual_seed(seed)
        kv = StaticCachedModel(model, B, 128) if static else None
        dm = DraftModel(model, B, VOCAB, warpers, greedy, downweight, gen, kv)
        cls = StaticSaguaroDrafter if static else SaguaroDrafter
        out.append(cls(dm, config, SSDStats(), BUDGET, greedy))
    return out


def test_sampled_static_draws_what_dynamic_draws(eager, monkeypatch):
    """Same seeds, same tree width (the dynamic fork padded to the budget): every round's tree tokens and q, and
    every speculation handed over (cache hit or JIT backup), are the dynamic drafter's."""
    monkeypatch.setattr(saguaro_mod, "fork", functools.partial(fork, width=BUDGET))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(40), TopPLogitsWarper(0.95)])
    model = get_pair("gemma3").related
    ids, mask = _batch()
    dyn, sta = _pair_of_drafters(model, 3, False, 0.5, warpers, seed=7)
    specs = [d.start(ids, mask) for d in (dyn, sta)]
    rows = 3
    for rnd in range(6):
        for d, s in zip((dyn, sta), specs):
            d.begin(s)
        torch.testing.assert_close(sta.cache.q, dyn.cache.q, atol=1e-5, rtol=0)
        assert torch.equal(sta.cache.tokens, dyn.cache.tokens)
        assert torch.equal(sta.cache.forks.tokens, dyn.cache.forks.tokens)
        spec = specs[0]
        g = torch.Generator().manual_seed(100 + rnd)
        k = torch.minimum(torch.randint(0, K + 1, (rows,), generator=g), spec.n)
        # half the rows take a bonus from the tree (a hit), the others a random token (a miss -> JIT backup)
        f = dyn.cache.forks
        guess = torch.where(f.valid & (f.depth == k[:, None]), f.tokens, -1).max(dim=1).values
        bonus = torch.where((torch.rand(rows, generator=g) < 0.5) & (guess >= 0), guess,
                            torch.randint(2, VOCAB - 1, (rows,), generator=g))
        keep = torch.ones(rows, dtype=torch.bool)
        if rnd == 3:
            keep[0] = False  # a row finishes: a dead row of the static batch
        contexts = [torch.arange(5)] * int(keep.sum())
        verdict = Verdict(Outcome(k, bonus), keep, contexts, [torch.ones(5)] * len(contexts), 0.01)
        results = [d.resolve(verdict) for d in (dyn, sta)]
        a, b = results[0].spec, results[1].spec
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.n, b.n) and torch.equal(a.source, b.source)
        torch.testing.assert_close(b.q, a.q, atol=1e-5, rtol=0)
        assert torch.equal(results[0].hits, results[1].hits)
        specs = [a, b]
        rows = int(keep.sum())
    assert sta.stats.cache_hits > 0 and sta.stats.backup_rounds["jit"] > 0


def test_sampled_generate_static_equals_dynamic(eager, monkeypatch):
    monkeypatch.setattr(saguaro_mod, "fork", functools.partial(fork, width=BUDGET))
    p = get_pair("llama")
    ids, mask = _batch()
    outs = []
    for compile_ in (False, True):
        torch.manual_seed(11)
        outs.append(ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=20, do_sample=True,
                                 temperature=1.0, top_k=0, ssd_downweight=0.5, return_dict_in_generate=True,
                                 **{**STATIC, "ssd_compile": compile_}))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[1].ssd_stats["draft_static"]
    for key in ("rounds", "cache_hits", "accept_hist"):
        assert outs[0].ssd_stats[key] == outs[1].ssd_stats[key]


# ---- no host reads on the hot path ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,greedy", [(a, True) for a in ARCHS] + [("llama", False), ("gemma3", False)])
def test_no_host_sync_on_the_hot_path(arch, greedy, host_reads, eager):
    """From the start of a round's tree to its lookup (glue forward, fork, K tree steps with proposals, lookup),
    the static drafter never reads a tensor on the host; also with a dead row in the batch."""
    calls, state = host_reads
    warpers = LogitsProcessorList([] if greedy else [TemperatureLogitsWarper(0.8), TopKLogitsWarper(20),
                                                     TopPLogitsWarper(0.9)])
    model = get_pair(arch).related
    ids, mask = _batch()
    _, sta = _pair_of_drafters(model, 3, greedy, 0.5, warpers, seed=3)
    spec = sta.start(ids, mask)
    rows = 3
    for rnd in range(3):
        state["on"] = True
        sta.begin_no_sync(spec)
        k = torch.zeros(rows, dtype=torch.long)
        outcome = Outcome(k, sta.cache.forks.tokens[:, 0])
        hit, branch = sta.cache.lookup(outcome)
        state["on"] = False
        assert calls == [], f"round {rnd}: host reads {calls}"
        keep = torch.ones(rows, dtype=torch.bool)
        keep[0] = rnd != 0  # row 0 finishes after the first round
        verdict = Verdict(outcome, keep, [torch.arange(5)] * int(keep.sum()), [torch.ones(5)] * int(keep.sum()), 0.0)
        spec = sta.resolve(verdict).spec
        rows = int(keep.sum())
    # the check itself works
    state["on"] = True
    bool(torch.ones(()))
    state["on"] = False
    assert calls == ["__bool__"]


# ---- compiled -----------------------------------------------------------------------------------------------------------
@pytest.fixture
def dynamo(monkeypatch):
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    counters.clear()
    with inductor_config.patch(compile_threads=1):  # no worker pool: faster on a small machine
        yield counters


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_identity_no_breaks_no_recompiles(arch, B, dynamo, monkeypatch):
    """... with forwards over views of 16, 32, 64 and 128 slots (static_kv._slot_view): one graph per width serves
    them all."""
    counters = dynamo
    monkeypatch.setattr(static_kv, "VIEW_BUCKET", 16)
    p = get_pair(arch)
    ids, mask = left_pad([prompt(9, seed=20 + i)[0] for i in range(B)])
    new = 48
    info = hf_ssd.warmup(p.target, p.related, batch_size=B, max_new_tokens=new, prompt_len=ids.shape[1], K=K,
                         budget=BUDGET, progress=False)
    # the backup's single steps, the glue = the tree, the first tree step of a round that carries the tree over
    assert info["compiled"] and info["widths"] == [1, K + 1, BUDGET + 1]
    graphs = counters["stats"]["unique_graphs"]
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=new)
    worker = "thread" if B == 2 else "inline"  # compiled graphs run in the draft thread too
    for attempt in range(2):
        # a second generate() reuses the graphs; any recompilation would be an error (and a fallback_reason)
        with torch._dynamo.config.patch(error_on_recompile=attempt == 1):
            out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=new,
                               return_dict_in_generate=True, **{**STATIC, "ssd_worker": worker})
        st = out.ssd_stats
        assert torch.equal(out.sequences, ref)
        assert st["draft_static"] and st["draft_compiled"] and st["fallback_reason"] is None
        assert st["draft_compile_s"] == 0.0  # compiled by the warm-up
        assert st["rounds"] >= 20
    assert counters["stats"]["unique_graphs"] == graphs  # no new graph in 2 generations of 20+ rounds
    assert not counters["graph_break"]
    assert info["compile_s"] > 0 or graphs == 0


@pytest.mark.parametrize("B", [1, 2])
def test_a_width_first_compiled_over_the_whole_cache_serves_shorter_views(B, dynamo, monkeypatch):
    """A width whose first compiled forward attends over all M slots (its first use late in a long call) serves
    the shorter views of a later call with the same graph: no recompile. Without the spare slot past the cache's last
    (slot_step.SPARE_SLOTS) the trace over all M learned that K, V and the validity were contiguous, tying the view's
    width to M, and the width was traced again (or, marked dynamic, failed to compile)."""
    counters = dynamo
    monkeypatch.setattr(static_kv, "VIEW_BUCKET", 16)
    model = get_pair("llama").related
    static_registry.clear(model)
    spans, view = [], StaticCachedModel._slot_view

    def spy(self, args, n):
        args = view(self, args, n)
        spans.append(args[4].shape[1])  # the validity's width: the slots the forward attends over
        return args

    monkeypatch.setattr(StaticCachedModel, "_slot_view", spy)

    def run(prefill: int) -> torch.Tensor:
        kv = StaticCachedModel(model, B, 64, compile=True, hot_widths=(4,))
        ids = torch.cat([prompt(prefill + 12, seed=40 + b) for b in range(B)])
        pos = torch.arange(prefill + 12).expand(B, -1)
        kv.forward(ids[:, :prefill], pos[:, :prefill], prefill=True)
        logits = [kv.forward(ids[:, s:s + 4], pos[:, s:s + 4]) for s in range(prefill, prefill + 12, 4)]
        kv.release()
        return torch.cat(logits, dim=1)

    run(44)  # width-4 forwards after a 44-token prefill: every view spans the whole cache
    assert spans == [64, 64, 64]
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    spans.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        short = run(5)
    assert spans == [16, 16, 32]  # views shorter than the cache
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        monkeypatch.setattr(static_kv, "COMPILE_ENABLED", False)
        eager = run(5)
    torch.testing.assert_close(short, eager, rtol=1e-4, atol=1e-4)


def test_every_width_compiles_before_the_first_round(dynamo, monkeypatch):
    """Which widths a generation meets can depend on timing (the "auto" backup picks the JIT's single steps from
    measured costs): all hot widths compile before the prompt, so a later generation that first takes another path
    builds no graph mid-round. Each tree's compiled forwards are timed by width (control.tree_cost prices trees off
    them)."""
    counters = dynamo
    from hf_ssd.draft.static_saguaro import StaticSaguaroDrafter

    timed, begin = [], StaticSaguaroDrafter.begin

    def spy(self, spec):
        begin(self, spec)
        timed.append(self.stats.draft_forward_s)

    monkeypatch.setattr(StaticSaguaroDrafter, "begin", spy)
    p = get_pair("llama")
    static_registry.clear(p.related)  # no graphs from earlier tests
    ids, mask = left_pad([prompt(7, seed=31)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=24, return_dict_in_generate=True,
                       **{**STATIC, "ssd_backup": "ngram"})  # never a single-token draft step in this one
    assert torch.equal(out.sequences, ref) and out.ssd_stats["draft_compiled"]
    assert out.ssd_stats["draft_compile_s"] > 0
    entry, = [e for e in static_registry.registry_entries(p.related) if e.batch == 1]
    assert entry.compiled_widths == {1, K + 1, BUDGET + 1}
    graphs = counters["stats"]["unique_graphs"]
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=24, return_dict_in_generate=True,
                       **STATIC)  # the JIT backup: single steps after each miss
    assert torch.equal(out.sequences, ref) and out.ssd_stats["draft_compile_s"] == 0.0
    assert counters["stats"]["unique_graphs"] == graphs
    last = timed[-out.ssd_stats["rounds"]:]  # this generation's trees: compiled, none compiling
    assert last and all(t is not None and sum(c for _, c in t.values()) == K + 1 for t in last)
    assert all(width in (K + 1, BUDGET) and s > 0 for t in last for width, (s, _) in t.items())


def test_a_shorter_generation_reuses_a_larger_free_entry(dynamo, monkeypatch):
    """Static buffers are sized in buckets of max_length: a generation whose bucket is smaller than a free entry's
    (up to static_registry.REUSE_LARGER times) runs on that entry and its compiled graphs instead of compiling its own,
    with the same tokens. (Buckets from the smallest, BUCKET, not the floor MIN_SLOTS: a short test.)"""
    counters = dynamo
    monkeypatch.setattr(static_kv, "MIN_SLOTS", static_kv.BUCKET)
    p = get_pair("llama")
    static_registry.clear(p.related)
    ids, mask = left_pad([prompt(7, seed=32)[0]])
    long = static_kv.BUCKET + 8  # max_new_tokens putting the first generation one bucket up
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=long,
                       return_dict_in_generate=True, **STATIC)
    assert out.ssd_stats["draft_compile_s"] > 0
    graphs = counters["stats"]["unique_graphs"]
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=16)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=16,
                       return_dict_in_generate=True, **STATIC)
    assert torch.equal(out.sequences, ref) and out.ssd_stats["draft_compiled"]
    assert out.ssd_stats["draft_compile_s"] == 0.0 and counters["stats"]["unique_graphs"] == graphs
    entry, = [e for e in static_registry.registry_entries(p.related) if e.batch == 1]
    assert entry.max_cache_len > static_kv.BUCKET  # the one larger entry served both


def test_prompts_of_different_buckets_share_one_cache_size(dynamo):
    """Under MIN_SLOTS slots every call gets the same cache size, so a long prompt after a short one runs on the
    short one's entry and graphs: nothing compiles again (with buckets alone, 256 and 1024 slots here)."""
    counters = dynamo
    p = get_pair("llama")
    static_registry.clear(p.related)
    sizes = [static_kv.static_cache_len(P + 16, K, BUDGET) for P in (7, 600)]
    assert sizes == [static_kv.MIN_SLOTS] * 2
    assert static_kv.bucketed(7 + 16, static_kv.BUCKET) < static_kv.bucketed(600 + 16, static_kv.BUCKET)
    graphs = None
    for P in (7, 600):
        ids = prompt(P, seed=33)
        ref = plain_generate(p.target, ids, max_new_tokens=16)
        out = ssd_generate(p.target, p.related, ids, max_new_tokens=16, return_dict_in_generate=True, **STATIC)
        assert torch.equal(out.sequences, ref) and out.ssd_stats["draft_compiled"]
        if graphs is not None:
            assert out.ssd_stats["draft_compile_s"] == 0.0 and counters["stats"]["unique_graphs"] == graphs
        graphs = counters["stats"]["unique_graphs"]
    entry, = [e for e in static_registry.registry_entries(p.related) if e.batch == 1]
    assert entry.max_cache_len == static_kv.MIN_SLOTS


@pytest.mark.parametrize("failures", [1, static_registry.COMPILE_TRIES])
def test_a_failed_compile_runs_eagerly_and_is_tried_again_next_generation(monkeypatch, failures):
    """Compiling is an optimisation: a width whose compile fails runs eagerly for the rest of the generation (same
    tokens, one warning) and compiles again in the next generation, until it has failed COMPILE_TRIES times; then
    it stays eager. (A failure can be transient: dynamo once failed while another thread ran graphs.)"""
    p = get_pair("llama")
    static_registry.clear(p.related)
    real = static_registry.Entry.compiled_step
    left = {"n": failures, "width": None}

    def flaky(self, width):
        fn = real(self, width)
        left["width"] = left["width"] or width  # the first width compiled fails, `failures` times

        def call(*args):
            if left["n"] > 0 and width == left["width"]:
                left["n"] -= 1
                raise RuntimeError("Unsupported: Failed to convert args/kwargs to proxy (injected)")
            return fn(*args)
        return call

    monkeypatch.setattr(static_registry.Entry, "compiled_step", flaky)
    ids, mask = left_pad([prompt(7, seed=33)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=12)
    for generation in range(failures + 1):
        with pytest.warns(RuntimeWarning, match="compiling the static-cache forward") if generation < failures \
                else warnings.catch_warnings():
            out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=12,
                               return_dict_in_generate=True, **STATIC)
        assert torch.equal(out.sequences, ref)
    entry, = [e for e in static_registry.registry_entries(p.related) if e.batch == 1]
    assert entry.compile_failures == {left["width"]: failures}
    failed = left["width"]
    assert (failed in entry.compiled_widths) == (failures < static_registry.COMPILE_TRIES)
    static_registry.clear(p.related)


def test_compile_auto_on_cpu_probes_once(dynamo):
    """"auto" on CPU: one measured probe (eager vs compiled tree forward), kept per process; exact either way."""
    p = get_pair("llama")
    ids, mask = left_pad([prompt(9, seed=20)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=24)
    for _ in range(2):
        out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=24,
                           return_dict_in_generate=True, **{**STATIC, "ssd_compile": "auto"})
        assert torch.equal(out.sequences, ref)
    entries = static_registry.registry_entries(p.related)
    probed = [e.probe for e in entries if e.batch == 1 and e.probe]
    assert probed and all(list(pr) == [BUDGET] for pr in probed)
    assert out.ssd_stats["draft_static"] == probed[0][BUDGET]
