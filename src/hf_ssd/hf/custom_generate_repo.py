"""Write a Hub `custom_generate` repository that runs SSD for users who never import hf_ssd:

    model.generate(ids, custom_generate="<repo id or local dir>", trust_remote_code=True, assistant_model=draft)

Layout: `custom_generate/generate.py` (a `generate(model, **kwargs)` function, transformers' convention),
`custom_generate/requirements.txt` (checked by transformers before loading), an optional `ssd_config.json`
reference copy, and a README.md. transformers passes every generate() argument by keyword (inputs,
generation_config, assistant_model, streamer, ... and the rest of **kwargs), so the function forwards them all to
hf_ssd's wrapper with ssd=True; `ssd_*` keyword options and `ssd_config=` work as with `import hf_ssd`.

CLI: python -m hf_ssd.hf.custom_generate_repo OUT_DIR [--config ssd_config.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_ssd import __version__
from hf_ssd.config import SSDConfig

GENERATE_PY = '''"""custom_generate entry point for SSD / Saguaro speculative decoding (written by hf_ssd {version}).

    model.generate(input_ids, custom_generate="<this repo>", trust_remote_code=True, assistant_model=draft_model)

Exact: greedy output is identical to plain greedy decoding; sampled output has the same distribution.
Options: `ssd_config=SSDConfig(...)` or `ssd_<option>=...` keywords (e.g. ssd_num_draft_tokens=4, ssd_mode="sync").
A config stored under the `ssd_config` key of the draft's (else the target's) generation_config.json is used
when none is given.
"""
from transformers import GenerationMixin

_before = GenerationMixin.generate
import hf_ssd  # noqa: E402  (importing hf_ssd patches GenerationMixin.generate; undone just below)
from hf_ssd.hf.generate import generate as _ssd_generate  # noqa: E402

if GenerationMixin.generate is not _before:
    GenerationMixin.generate = _before  # leave the caller's transformers as it was


def generate(model, **kwargs):
    """Run `model.generate(**kwargs)` with SSD. `assistant_model` (the draft) is required."""
    kwargs.pop("custom_generate", None)
    kwargs.pop("trust_remote_code", None)
    if kwargs.get("assistant_model") is None:
        raise ValueError(
            "this custom_generate repo runs SSD speculative decoding and needs a draft model: "
            "model.generate(..., custom_generate=..., trust_remote_code=True, assistant_model=draft_model)"
        )
    kwargs.setdefault("ssd", True)
    return _ssd_generate(model, **kwargs)
'''

README = """---
library_name: transformers
tags:
- custom_generate
- speculative-decoding
- ssd
---

# SSD / Saguaro speculative decoding as a `custom_generate` repo

Runs exact Speculative Speculative Decoding ([hf_ssd]({home})) inside `model.generate` without importing hf_ssd:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-Coder-1.5B-Instruct")
draft = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-Coder-0.5B-Instruct")
tok = AutoTokenizer.from_pretrained("Qwen/Qwen2.5-Coder-1.5B-Instruct")
ids = tok("def fib(n):", return_tensors="pt").input_ids
out = target.generate(ids, custom_generate="<this repo or a local copy>", trust_remote_code=True,
                      assistant_model=draft, max_new_tokens=64, do_sample=False)
```

Requirements (`custom_generate/requirements.txt`): {requirements}.
Options: `ssd_config=` or `ssd_<option>=` keywords, as with `import hf_ssd`; `ssd_config.json` here is a reference
configuration (pass it with `ssd_config=SSDConfig.from_pretrained(...)` or store it in a model's generation_config).
"""


def requirements() -> list[str]:
    return [f"hf-ssd>={__version__}", "transformers>=5.23", "torch>=2.4"]


def write_custom_generate_repo(out_dir: str | Path, config: SSDConfig | None = None,
                               home: str = "https://github.com/") -> Path:
    """Write the layout into `out_dir` (created); returns it. Loadable with custom_generate=str(out_dir)."""
    out = Path(out_dir)
    (out / "custom_generate").mkdir(parents=True, exist_ok=True)
    (out / "custom_generate" / "generate.py").write_text(GENERATE_PY.format(version=__version__))
    (out / "custom_generate" / "requirements.txt").write_text("\n".join(requirements()) + "\n")
    (out / "README.md").write_text(README.format(home=home, requirements=", ".join(requirements())))
    if config is not None:
        config.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_ssd.hf.custom_generate_repo", description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--config", help="an ssd_config.json (or directory) to include as the reference config")
    args = p.parse_args(argv)
    config = SSDConfig.from_pretrained(args.config) if args.config else None
    print(write_custom_generate_repo(args.out_dir, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
