"""SSDConfig: every option of SSD decoding, validated once, serialisable to JSON."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

CONFIG_NAME = "ssd_config.json"
CONFIG_VERSION = 1

MODES = ("auto", "ssd", "sync")
QUANTIZE = ("auto", "int8", None)
BACKUPS = ("auto", "jit", "ngram")
WORKERS = ("auto", "inline", "thread", "process")
class OptionTypeError(TypeError, ValueError):
    """An option of the wrong type: a TypeError, and also a ValueError (as every other invalid option is)."""


MAX_BUDGET = 4096  # branches per row; more only slows the tree build (and the cap below V and K applies anyway)

# The type each option must have (None is allowed where the default is None); checked before any value.
INT_OPTIONS = ("num_draft_tokens", "budget", "backup_batch_threshold", "ngram_max", "draft_threads", "target_threads")
FLOAT_OPTIONS = ("alpha", "alpha_prior", "power_r", "downweight", "draft_temperature")
STR_OPTIONS = ("mode", "backup", "worker", "draft_device", "draft_quantize")
BOOL_OPTIONS = ("trust_processors", "compile_target")
LIST_OPTIONS = ("fanout", "fanout_after_miss")


@dataclass
class SSDConfig:
    """Options of `generate(..., ssd=True)`; each is also accepted as an `ssd_<name>` keyword argument.

    `mode="ssd"` is Saguaro; `mode="sync"` is plain (synchronous) speculative decoding, the exact fallback;
    `mode="auto"` lets the online controller (hf_ssd.control) pick the fastest exact way for this pair, hardware and
    batch: SSD, synchronous SD or plain target steps. Every option left unset (None / "auto") is the controller's
    to choose; an option that is set is obeyed.
    """

    mode: str = "auto"
    num_draft_tokens: int | None = None  # K: drafts verified per round (None = chosen by the controller)
    budget: int | None = None  # branches per row in the speculation cache; None = measured at start-up
    fanout: list[int] | None = None  # explicit F_0..F_K after a hit (overrides the geometric schedule)
    fanout_after_miss: list[int] | None = None  # explicit F_0..F_K after a miss
    alpha: float | None = None  # fixed acceptance rate for the fan-out (None = estimated online)
    # the α the online estimate starts from, before a generation's own rounds (None: 0.7); ssd=True passes the α it
    # measured for the pair, so a call's first tree covers the outcomes that are likely, not those of the prior
    alpha_prior: float | None = None
    power_r: float | None = None  # fixed power-law exponent r of the miss rate (None = estimated online)
    downweight: float = 1.0  # Saguaro sampling constant C in [0, 1]; 1 = plain sampling
    backup: str = "auto"  # on a cache miss: "jit" neural draft, "ngram" prompt lookup, "auto" = by batch size
    backup_batch_threshold: int | None = None  # b*: batch size from which the fast backup is used (None = computed)
    ngram_max: int = 3  # longest n-gram the prompt-lookup backup matches
    draft_temperature: float | None = None  # draft-only temperature (exact: the verifier uses the same q)
    worker: str = "auto"  # where the draft runs: inline, thread, process
    draft_device: str | None = None  # device for the draft (None: where it is; "auto": hardware the target leaves free)
    draft_quantize: str | None = "auto"  # "int8": dynamic int8 draft copy on CPU (exact: q is the copy's); "auto": if faster
    draft_threads: int | None = None  # torch intra-op threads for the draft side (CPU)
    target_threads: int | None = None  # torch intra-op threads for the target side (CPU)
    trust_processors: bool = False  # True: custom logits processors are pure functions of (input_ids, scores); no warning
    compile: bool | str = False  # static-shape draft cache, glue + tree under torch.compile; "auto": CUDA, or CPU if faster
    compile_target: bool = False  # the target's verify too: static cache, compiled fixed-width block (compiled numerics)
    # few-row float32 forwards (verify blocks, draft steps) through weights packed once (AVX-512 CPU kernel, a
    # second copy of the large weights): True, False, or "auto" = where it builds and the memory is free
    packed_linear: bool | str = "auto"
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"ssd_{name}={getattr(self, name)!r} is invalid: {why}")

        self._check_types()
        if self.mode not in MODES:
            raise bad("mode", f"choose one of {MODES}")
        if self.num_draft_tokens is not None and (
                not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= 64):
            raise bad("num_draft_tokens", "use an integer between 1 and 64, or None to let the controller choose")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise bad("budget", "use a positive integer (branches per row) or None to measure it")
        if self.budget is not None and self.budget > MAX_BUDGET:
            raise bad("budget", f"at most {MAX_BUDGET} branches per row (a larger tree only costs time: the cache "
                                "never holds more than (K+1)*(V-1)+1 distinct outcomes); or None to measure it")
        for name in ("fanout", "fanout_after_miss"):
            value = getattr(self, name)
            if value is None:
                continue
            if self.num_draft_tokens is None:
                raise bad(name, "an explicit fan-out needs an explicit K: set num_draft_tokens too")
            if len(value) != self.num_draft_tokens + 1 or any(not isinstance(f, int) or f < 0 for f in value):
                raise bad(name, f"give num_draft_tokens+1 = {self.num_draft_tokens + 1} non-negative integers")
        if self.alpha is not None and not 0.0 < self.alpha < 1.0:
            raise bad("alpha", "use a float strictly between 0 and 1, or None to estimate it")
        if self.alpha_prior is not None and not 0.0 < self.alpha_prior <= 1.0:
            raise bad("alpha_prior", "use a float in (0, 1], or None to start from 0.7")
        if self.power_r is not None and not self.power_r > 0.0:
            raise bad("power_r", "use a positive float, or None to estimate it")
        if not 0.0 <= float(self.downweight) <= 1.0:
            raise bad("downweight", "Saguaro's C must lie in [0, 1] (1 = plain sampling)")
        if self.backup not in BACKUPS:
            raise bad("backup", f"choose one of {BACKUPS}")
        if self.backup_batch_threshold is not None and self.backup_batch_threshold < 1:
            raise bad("backup_batch_threshold", "use a positive integer or None")
        if not isinstance(self.ngram_max, int) or self.ngram_max < 1:
            raise bad("ngram_max", "use a positive integer")
        if self.draft_temperature is not None and not self.draft_temperature > 0.0:
            raise bad("draft_temperature", "use a positive float (greedy drafting: leave it None with do_sample=False)")
        if self.worker not in WORKERS:
            raise bad("worker", f"choose one of {WORKERS}")
        if self.mode == "sync" and self.worker not in ("auto", "inline"):
            raise bad("worker", "ssd_worker applies to ssd_mode='ssd' (the Saguaro draft side); synchronous SD "
                                "(ssd_mode='sync') drafts inline: drop ssd_worker or use ssd_mode='ssd' or 'auto'")
        if self.draft_device not in (None, "auto"):
            import torch

            try:
                device = torch.device(self.draft_device)
            except (RuntimeError, TypeError, ValueError) as e:
                raise bad("draft_device", f"not a torch device ({e}); use e.g. 'cpu', 'cuda' or 'cuda:1'") from None
            if device.type == "meta":
                raise bad("draft_device", "'meta' holds no weights, so the draft could not run; use a real device "
                                          "('cpu', 'cuda', ...) or None to keep the draft where it is")
        if self.draft_quantize not in QUANTIZE:
            raise bad("draft_quantize", 'use "int8" (CPU dynamic int8 draft), None (off) or "auto" (int8 where faster)')
        for name in ("draft_threads", "target_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise bad(name, "use a positive integer")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise bad("compile", 'use True (static draft cache, compiled), False (off) or "auto" (on where faster)')
        if not (isinstance(self.packed_linear, bool) or self.packed_linear == "auto"):
            raise bad("packed_linear", 'use True (packed few-row kernel), False (torch\'s GEMM) or "auto"')
        if self.version > CONFIG_VERSION:
            raise bad("version", f"this hf_ssd reads config versions <= {CONFIG_VERSION}; upgrade hf_ssd")

    def _check_types(self) -> None:
        """TypeError naming the option for a value of the wrong type (a string, a float for an integer, NaN, a bool
        for a number); integral and real numbers of other types (numpy) are normalised to int / float."""
        import math
        import numbers

        def wrong(name: str, want: str) -> TypeError:
            value = getattr(self, name)
            return OptionTypeError(f"ssd_{name}={value!r} is invalid: use {want} (got {type(value).__name__})")

        for name in INT_OPTIONS + ("version",):
            value = getattr(self, name)
            if value is None and name != "version":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise wrong(name, "an integer" + ("" if name == "version" else " or None"))
            setattr(self, name, int(value))
        for name in FLOAT_OPTIONS:
            value = getattr(self, name)
            if value is None and name != "downweight":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise wrong(name, "a number" + ("" if name == "downweight" else " or None"))
            if not math.isfinite(float(value)):
                raise ValueError(f"ssd_{name}={value!r} is invalid: use a finite number")
            setattr(self, name, float(value))
        for name in STR_OPTIONS:
            value = getattr(self, name)
            if name == "draft_device" and value is not None and type(value).__name__ == "device":
                self.draft_device = value = str(value)  # a torch.device
            if value is not None and not isinstance(value, str):
                raise wrong(name, "a string" + (" or None" if name in ("draft_device", "draft_quantize") else ""))
        for name in BOOL_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise wrong(name, "True or False")
        for name in LIST_OPTIONS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or any(
                    isinstance(f, bool) or not isinstance(f, numbers.Integral) for f in value):
                raise wrong(name, "a list of integers or None")
            setattr(self, name, [int(f) for f in value])

    # ---- construction from kwargs / dicts ----------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SSDConfig:
        data = dict(data)
        version = data.get("version", CONFIG_VERSION)
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"SSD config version {version!r} is not valid; expected an integer >= 1")
        unknown = set(data) - cls.field_names()
        if unknown:
            raise ValueError(f"unknown SSD config keys {sorted(unknown)}; valid keys: {sorted(cls.field_names())}")
        return cls(**data)

    def updated(self, **overrides: Any) -> SSDConfig:
        return SSDConfig.from_dict({**self.to_dict(), **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- files --------------------------------------------------------------------------------------------------
    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w") as f:
            f.write(self.to_json_string())
        return path

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> SSDConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    # ---- Hub (implemented in hf_ssd.hf.hub) ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **kwargs: Any) -> SSDConfig:
        """From a directory, JSON file or Hub repo id: ssd_config.json, else generation_config.json's `ssd_config`."""
        from hf_ssd.hf.hub import from_pretrained

        return from_pretrained(name_or_path, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs: Any):
        """Upload as ssd_config.json to the Hub model repo `repo_id` (see hf_ssd.hf.hub.push_to_hub)."""
        from hf_ssd.hf.hub import push_to_hub

        return push_to_hub(self, repo_id, **kwargs)


def config_from_kwargs(base: SSDConfig | dict | None, kwargs: dict[str, Any]) -> SSDConfig:
    """Pop every `ssd_*` keyword from `kwargs` and merge it over `base`; unknown names are an error."""
    overrides = {}
    for key in [k for k in kwargs if k.startswith("ssd_")]:
        name = key[len("ssd_"):]
        if name not in SSDConfig.field_names() or name == "version":
            valid = ", ".join(f"ssd_{n}" for n in sorted(SSDConfig.field_names() - {"version"}))
            raise TypeError(f"generate() got an unknown SSD option `{key}`; valid options: {valid}")
        overrides[name] = kwargs.pop(key)
    if base is None:
        base = SSDConfig()
    elif isinstance(base, dict):
        base = SSDConfig.from_dict(base)
    elif not isinstance(base, SSDConfig):
        raise TypeError(f"ssd_config must be an SSDConfig or a dict, got {type(base).__name__}")
    return base.updated(**overrides) if overrides else base
