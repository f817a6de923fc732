"""model_cards/: every card's YAML + config is valid (the CI check), and the checker catches broken cards."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_model_cards", ROOT / "scripts" / "check_model_cards.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_all_cards_valid():
    assert check.main(["--cards", str(ROOT / "model_cards")]) == 0
    names = {d.name for d in (ROOT / "model_cards").iterdir() if d.is_dir()}
    assert {"qwen2.5-coder-1.5b-0.5b", "llama-3.1-70b-3.2-1b", "qwen3-32b-0.6b"} <= names


def test_paper_cards_use_reference_config():
    from hf_ssd import SSDConfig

    for name in ("llama-3.1-70b-3.2-1b", "qwen3-32b-0.6b"):
        cfg = SSDConfig.from_pretrained(ROOT / "model_cards" / name)
        assert cfg.num_draft_tokens == 7 and cfg.fanout == [3] * 8 and sum(cfg.fanout) == 24 == cfg.budget
        assert "not measured by us" in (ROOT / "model_cards" / name / "README.md").read_text().lower()


@pytest.fixture
def card(tmp_path):
    dst = tmp_path / "cards" / "qwen"
    shutil.copytree(ROOT / "model_cards" / "qwen2.5-coder-1.5b-0.5b", dst)
    readme = dst / "README.md"  # back to the unfilled state the checker tests start from
    text = readme.read_text()
    placeholder = ("**Placeholder: not measured yet.**\n\n| setting | T | batch | method | tok/s (decode) | speedup vs "
                   "plain | tokens/round | hit rate | greedy identical |\n|---|---|---|---|---|---|---|---|---|\n"
                   "| – | – | – | – | – | – | – | – | – |\n")
    readme.write_text(text[:text.index(check.START) + len(check.START)] + "\n" + placeholder + text[text.index(check.END):])
    return dst


@pytest.mark.parametrize("breakage, match", [
    (lambda d: (d / "ssd_config.json").write_text('{"num_draft_tokens": 0}'), "ssd_config.json invalid"),
    (lambda d: (d / "ssd_config.json").write_text('{"bogus": 1}'), "unknown SSD config keys"),
    (lambda d: (d / "ssd_config.json").unlink(), "ssd_config.json missing"),
    (lambda d: _edit(d, "library_name: transformers", "library_name: vllm"), "library_name"),
    (lambda d: _edit(d, "- hf_ssd\n", ""), "tags must include"),
    (lambda d: _edit(d, "- Qwen/Qwen2.5-Coder-0.5B-Instruct\n", "- not a repo id\n"), "base_model"),
    (lambda d: _edit(d, "| – | – |", "| 12.5 | 3 |"), "placeholder results table contains numbers"),
    (lambda d: _edit(d, "tags:\n", "tags: [\n"), "YAML metadata unreadable"),
])
def test_checker_catches(card, breakage, match):
    breakage(card)
    errs = check.check_card(card)
    assert any(match in e for e in errs), errs


def _edit(d, old, new):
    p = d / "README.md"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))


def test_fill_from_benchmark_json(card, tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    report = {"command": "hf-ssd bench --pair default", "created": "2026-01-01", "models": {"pair": "default: Qwen2.5-Coder 1.5B target + 0.5B draft"},
              "machine": {"cpu": "test cpu"}, "results": [
                  {"setting": "greedy", "temperature": 0.0, "batch_size": 1, "method": "ssd",
                   "tokens_per_s_decode": 5.5, "speedup_vs_plain": 1.3, "mean_tokens_per_round": 2.1,
                   "hit_rate": 0.6, "greedy_equal": True}]}
    (bench / "r.json").write_text(json.dumps(report))
    assert check.fill(card.parent, bench) == ["qwen"]
    text = (card / "README.md").read_text()
    assert "hf-ssd bench --pair default" in text and "| greedy | 0.0 | 1 | ssd | 5.50 | 1.30 | 2.10 | 0.60 | yes |" in text
    assert "Placeholder" not in text.split(check.START)[1]
    assert check.check_card(card) == []
