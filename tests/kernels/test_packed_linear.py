"""The packed few-row linear kernel (hf_ssd.kernels.packed_linear): its layout and products against plain-torch
references, where its mode applies, which models get it, and the engine's greedy output with it on."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from hf_ssd.kernels import packed_linear as pl
from hf_ssd.testing import ARCHS, get_pair, left_pad, plain_generate, prompt, ssd_generate

pytestmark = pytest.mark.skipif(pl.unavailable_reason() is not None,
                                reason=f"packed kernel unavailable here: {pl.unavailable_reason()}")


@pytest.mark.parametrize("N,K", [(1, 1), (33, 17), (64, 64), (100, 7), (300, 129)])
def test_pack_matches_the_reference_layout(N, K):
    w = torch.randn(N, K)
    assert torch.equal(pl.pack(w), pl.pack_reference(w))
    assert torch.equal(pl.pack(w.t().contiguous().t()), pl.pack_reference(w))  # any strides in


@pytest.fixture(params=["avx512", "avx2"])
def isa(request, monkeypatch):
    """Each kernel variant this CPU can run (an AVX-512 CPU runs the AVX2 one too)."""
    if request.param == "avx512" and pl.cpu_isa() != "avx512":
        pytest.skip("no AVX-512 here")
    monkeypatch.setattr(pl, "ISA", request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 11, 12, 13, 24, 25, 48])
@pytest.mark.parametrize("N,K", [(33, 17), (100, 64), (257, 300)])
def test_products_are_torch_s_up_to_float32_rounding(isa, rows, N, K):
    gen = torch.Generator().manual_seed(rows * 1000 + N)
    w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    x = torch.randn(rows, K, generator=gen)
    exact = F.linear(x.double(), w.double(), b.double())
    got = pl.packed_linear(x, pl.pack(w), N, b)
    ref = pl.packed_linear_reference(x, pl.pack_reference(w), N, b)
    assert got.shape == (rows, N)
    # The same products summed in another order. Any float32 summation of n terms lies within gamma_n * sum |terms|
    # of the exact sum (gamma_n = n u / (1 - n u), u = 2^-24: the textbook bound for a dot product, whatever the
    # order). Not "as close as torch's GEMM": that depends on the BLAS (MKL on an Intel Xeon summed these within
    # 6.6e-6 where sequential float32 sums land 4e-5 off, and a bound of 4x torch's error failed there). A wrong
    # product or a dropped term is off by ~1, far outside.
    n, u = K + 1, 2.0**-24
    bound = n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert ((F.linear(x, w, b).double() - exact).abs() <= bound).all()  # the bound holds for torch's GEMM too
    assert ((ref.double() - exact).abs() <= bound).all()
    assert ((got.double() - exact).abs() <= bound).all()


def test_a_call_runs_on_torch_s_threads():
    """Built without OpenMP, at::parallel_for runs serially: the kernel then used one core whatever torch's thread
    count (the equal setting's forwards ran at half speed)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert pl.extension().threads_used(16) == 2
        torch.set_num_threads(1)
        assert pl.extension().threads_used(16) == 1
    finally:
        torch.set_num_threads(before)


def test_other_python_threads_run_while_the_kernel_does():
    """The kernel releases the GIL, as torch's operators do: a thread worker's draft runs its Python beside a
    packed verify. Held, this thread would stall for the whole call."""
    import threading
    import time

    w = torch.randn(4096, 2048)
    packed, x = pl.pack(w), torch.randn(512, 2048)  # a call of ~50 ms: far beyond Python's 5 ms switch interval
    kernel = pl.extension().packed_linear
    kernel(x, packed, 4096, pl.ISA == "avx512")
    started = time.perf_counter()
    kernel(x, packed, 4096, pl.ISA == "avx512")
    one_call = time.perf_counter() - started
    calls = 4
    done = threading.Event()

    def verify():
        for _ in range(calls):
            kernel(x, packed, 4096, pl.ISA == "avx512")
        done.set()

    worker = threading.Thread(target=verify)
    stamps = [time.perf_counter()]
    worker.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
    worker.join()
    longest_stall = max(b - a for a, b in zip(stamps, stamps[1:]))
    assert longest_stall < 0.5 * one_call, (longest_stall, one_call)


def test_leading_dimensions_are_kept(isa):
    w = torch.randn(40, 24)
    x = torch.randn(2, 3, 24)
    out = pl.packed_linear(x, pl.pack(w), 40)
    assert out.shape == (2, 3, 40)
    assert torch.allclose(out, F.linear(x, w), atol=1e-5)


def test_the_mode_serves_packed_weights_of_few_float32_rows_only(pack_everything):
    layer = torch.nn.Linear(32, 48)
    weights = pl.weights_for(layer, True)
    few, many = torch.randn(2, 32), torch.randn(weights.max_rows + 1, 32)
    with torch.no_grad(), pl.PackedLinearMode(weights):
        out_few = layer(few)
        assert pack_everything["n"] == 1
        out_many = layer(many)  # a prefill's rows: torch's GEMM
        out_double = torch.nn.Linear(32, 48).double()(few.double())  # not packed: untouched
        other = torch.nn.Linear(32, 48)
        other(few)  # a weight not packed
    assert pack_everything["n"] == 1
    assert out_double.dtype == torch.float64
    assert torch.equal(out_many, F.linear(many, layer.weight, layer.bias))
    assert torch.allclose(out_few, F.linear(few, layer.weight, layer.bias), atol=1e-5)


def test_rows_past_the_floor_are_packed_up_to_the_first_measured_loss():
    w = torch.randn(64, 32)
    packed = pl.pack(w)
    ladder = [r for r in pl.CALIBRATION_ROWS if r > pl.MAX_ROWS]

    def measured(loses_from, outlier_at=None):
        """Injected (packed, torch) seconds: the kernel loses from `loses_from` rows on, and its first
        measurement at `outlier_at` rows is a slow outlier."""
        seen = []

        def measure(rows):
            seen.append(rows)
            outlier = rows == outlier_at and seen.count(rows) == 1
            return (2.0 if rows >= loses_from or outlier else 0.5), 1.0
        return measure

    assert pl.rows_where_packed_wins(w, packed, measured(ladder[0])) == pl.MAX_ROWS
    assert pl.rows_where_packed_wins(w, packed, measured(ladder[2])) == ladder[1]
    assert pl.rows_where_packed_wins(w, packed, measured(10**9)) == ladder[-1]
    assert pl.rows_where_packed_wins(w, packed, measured(10**9, outlier_at=ladder[1])) == ladder[-1]
    state = torch.random.get_rng_state()
    assert pl.rows_where_packed_wins(w, packed) >= pl.MAX_ROWS  # the real measurement runs ...
    assert torch.equal(torch.random.get_rng_state(), state)  # ... and leaves the user's seeded samples alone


def test_the_measured_rows_decide_where_the_mode_hands_over(pack_everything):
    layer = torch.nn.Linear(32, 48)
    weights = pl.weights_for(layer, True)
    assert weights.max_rows >= pl.MAX_ROWS and f"up to {weights.max_rows} rows" in weights.summary
    weights.max_rows = 100
    with torch.no_grad(), pl.PackedLinearMode(weights):
        layer(torch.randn(100, 32))
        assert pack_everything["n"] == 1
        layer(torch.randn(101, 32))
    assert pack_everything["n"] == 1


def test_a_weight_edited_after_packing_is_not_served_stale(pack_everything):
    layer = torch.nn.Linear(16, 16)
    weights = pl.weights_for(layer, True)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # fine-tuned in place after packing
        x = torch.randn(3, 16)
        with pl.PackedLinearMode(weights):
            out = layer(x)
    assert pack_everything["n"] == 0
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


def test_which_models_are_packed(monkeypatch):
    monkeypatch.setattr(pl, "_MODELS", weakref.WeakKeyDictionary())
    tiny = get_pair("llama").target
    assert pl.weights_for(tiny, False) is None
    assert pl.weights_for(tiny, "auto") is None  # its weights stay in cache: nothing to gain
    with pytest.raises(ValueError, match="ssd_packed_linear"):
        pl.weights_for(tiny, True)
    monkeypatch.setattr(pl, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(pl, "_MODELS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(pl, "_available_memory", lambda: 0)  # "auto" never takes the machine's last memory
    assert pl.weights_for(tiny, "auto") is None
    packed = pl.weights_for(tiny, True)  # asked for: packs anyway
    assert packed is not None and pl.weights_for(tiny, "auto") is packed
    linears = [m for m in tiny.modules() if isinstance(m, torch.nn.Linear)]
    assert len(packed.by_id) == len({id(m.weight) for m in linears})  # tied weights packed once


@pytest.mark.parametrize("mode", ["sync", "ssd"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_plain_generate_s_with_the_kernel_on(pack_everything, arch, mode):
    p = get_pair(arch)
    ids, mask = left_pad([prompt(3, seed=1)[0], prompt(11, seed=2)[0]])
    ref = plain_generate(p.target, ids, attention_mask=mask, max_new_tokens=12)
    out = ssd_generate(p.target, p.related, ids, attention_mask=mask, max_new_tokens=12, ssd_mode=mode,
                       ssd_num_draft_tokens=3, ssd_packed_linear=True)
    assert torch.equal(out, ref), f"\nssd:   {out.tolist()}\nplain: {ref.tolist()}"
    assert pack_everything["n"] > 0


def test_the_option_is_validated():
    from hf_ssd.config import SSDConfig

    with pytest.raises(ValueError, match="packed_linear"):
        SSDConfig(packed_linear="yes")
    assert SSDConfig(packed_linear=False).packed_linear is False


def test_ssd_stats_say_whether_the_target_ran_packed(pack_everything):
    p = get_pair("llama")
    ids = prompt(5, seed=3)
    on = ssd_generate(p.target, p.related, ids, max_new_tokens=4, ssd_mode="sync", ssd_num_draft_tokens=2,
                      ssd_packed_linear=True, return_dict_in_generate=True)
    assert on.ssd_stats["packed_linear"].startswith("on: ")
    other = get_pair("gpt2")
    off = ssd_generate(other.target, other.related, ids, max_new_tokens=4, ssd_mode="sync", ssd_num_draft_tokens=2,
                       ssd_packed_linear=False, return_dict_in_generate=True)
    assert off.ssd_stats["packed_linear"].startswith("off: ")


def test_the_avx2_variant_leaves_single_rows_to_torch(pack_everything, monkeypatch):
    monkeypatch.setattr(pl, "ISA", "avx2")
    layer = torch.nn.Linear(32, 48)
    weights = pl.weights_for(layer, True)
    with torch.no_grad(), pl.PackedLinearMode(weights):
        one = layer(torch.randn(1, 32))
        layer(torch.randn(3, 32))
    assert pack_everything["n"] == 1 and one.shape == (1, 48)


def test_a_grouped_prefill_packs_only_what_its_cache_packs(monkeypatch):
    """ssd_packed_linear=False must not pack anything behind the user's back: the prefill's group caches follow
    the cache they fill."""
    from hf_ssd.runtime import prefill
    from hf_ssd.runtime.kv import CachedModel

    monkeypatch.setattr(pl, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(pl, "_MODELS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(prefill, "FORWARD_TOKENS", {"cpu": 1, "cuda": 1})  # group even this small batch
    model = get_pair("llama").target
    ids, mask = left_pad([prompt(3, seed=1)[0], prompt(11, seed=2)[0]])
    kv = CachedModel(model, 2, packed_linear=False)
    prefill.prefill_prompt(kv, ids, mask)
    assert kv.packed is None and pl._MODELS.get(model) is None


@pytest.mark.parametrize("packed_linear", [True, False])
def test_a_plain_hand_off_runs_packed_as_our_forwards_do(pack_everything, monkeypatch, packed_linear):
    """The controller prices plain decoding at our packed one-token step, so its hand-off to transformers' loop
    runs packed too (and not where the option is off); same tokens as plain generate()."""
    from transformers import GenerationMixin

    from hf_ssd.control import controller as ctl_mod

    monkeypatch.setattr(ctl_mod.Controller, "decide", lambda self, current=None, horizon=None:
                        ctl_mod.Decision(ctl_mod.Plan("plain"), "test: plain is fastest", []))
    in_loop = {"n": 0}  # kernel calls within transformers' loop (measuring the pair's costs makes some too)
    sample = GenerationMixin._sample

    def counted_sample(*args, **kwargs):
        before = pack_everything["n"]
        try:
            return sample(*args, **kwargs)
        finally:
            in_loop["n"] += pack_everything["n"] - before
    monkeypatch.setattr(GenerationMixin, "_sample", counted_sample)
    p = get_pair("llama")
    ids = prompt(6, seed=3)
    ref = plain_generate(p.target, ids, max_new_tokens=10)
    out = p.target.generate(ids, assistant_model=p.related, ssd=True, max_new_tokens=10, do_sample=False,
                            pad_token_id=0, ssd_packed_linear=packed_linear, return_dict_in_generate=True)
    assert out.ssd_stats["controller"]["choice"] == "plain"
    assert torch.equal(out.sequences, ref)
    assert (in_loop["n"] > 0) == packed_linear
