"""scripts/round_phases.py: plans parse, and a tiny eager run prints each plan's phases."""
import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "round_phases.py"


def test_plans_parse_and_bad_ones_say_the_form():
    parse_plan = runpy.run_path(str(SCRIPT))["parse_plan"]
    assert parse_plan("sd:8") == ("sync", 8, None)
    assert parse_plan("ssd:4:16") == ("ssd", 4, 16)
    with pytest.raises(ValueError, match="sd:K or ssd:K:budget"):
        parse_plan("ssd:4")


def test_a_tiny_inline_run_prints_each_plans_phases(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["round_phases.py", "--plans", "sd:2,ssd:2:4", "--prompts", "1",
                                      "--max-new-tokens", "8", "--repeats", "2", "--worker", "inline", "--eager"])
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        torch.set_num_threads(threads)  # the script runs on one thread
    lines = [line for line in capsys.readouterr().out.splitlines() if "tokens/round" in line]
    assert [line.split(":")[0] for line in lines] == ["sd K=2", "ssd K=2 budget=4"]
    assert all("verify" in line and "round" in line for line in lines)
    assert "hit" in lines[1]
