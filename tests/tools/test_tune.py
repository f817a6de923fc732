"""`hf-ssd doctor` explains the measured costs; `hf-ssd tune` writes the fastest plan as a config that a later
generate(..., ssd=True) picks up from the model directory."""
from __future__ import annotations


import json

import torch

from hf_ssd.config import SSDConfig
from hf_ssd.control.controller import Controller
from hf_ssd.control.memory import Memory
from hf_ssd.control.costs import Costs, Curve
from hf_ssd.control.explain import diagnose, largest_hidden_budget
from hf_ssd.testing import plain_generate, tiny_pair
from hf_ssd.tools.cli import main


def test_doctor_sentences_from_injected_costs():
    verify, draft = Curve.straight(0.100, 0.002), Curve.straight(0.010, 0.001)
    costs = Costs(1, verify, draft, verify, draft, (1, 1), Curve.straight(0.004, 0.0005), Curve.straight(0.004, 0.0005))
    # tree(N) = draft(5) + 4 * draft(N) = 0.055 + 0.004 N <= verify(5) = 0.11  ->  N <= 13; tree(32) = 0.183 s
    assert largest_hidden_budget(costs, 4, split=True) == 13
    text = "\n".join(diagnose(costs, Controller(costs, Memory(), 1, {}, fixed_alpha=0.8)))
    assert "A tree of 32 branches costs 1.66 verifies here: budget 13" in text
    assert "int8 copy of the draft" in text and "cores split 1+1" in text
    assert "Choice: ssd" in text
    assert "plain decoding runs at about 9.80 tok/s" in text  # 1 / verify(1) = 1 / 0.102 s


def test_doctor_runs_on_a_tiny_pair(capsys):
    assert main(["doctor", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert "A tree of 32 branches costs" in out and "Choice:" in out
    assert "Packed few-row linear kernel (ssd_packed_linear): target off: no float32 CPU Linear weight" in out


def test_tune_writes_a_config_that_generate_picks_up(tmp_path, monkeypatch):
    import hf_ssd.testing

    def loaded_from_a_directory():  # as from_pretrained leaves it: the model's name_or_path is its own directory
        target, draft, tokenizer = tiny_pair()
        target.name_or_path = target.config._name_or_path = str(tmp_path / "model")
        return target, draft, tokenizer

    monkeypatch.setattr(hf_ssd.testing, "tiny_pair", loaded_from_a_directory)
    assert main(["tune", "--tiny", "--out", str(tmp_path), "--modes", "sync,ssd", "--prompts", "1",
                 "--max-new-tokens", "8", "--repeats", "1", "--top", "1"]) == 0
    table = json.loads((tmp_path / "ssd_tune.json").read_text())
    assert len(table["tried"]) == 2 and table["prompt_set"] == "humaneval"
    check = table["check"]  # tune's own re-run of generate(ssd=True) with only the written config
    assert check["controller"] is None and check["mode"] == table["tried"][0]["options"]["mode"]
    assert check["median_tok_s"] > 0 and check["ratio_to_tuned"] > 0
    tuned = SSDConfig.from_pretrained(tmp_path)
    assert tuned.to_dict() == table["tried"][0]["options"]  # the fastest one
    target, draft, _ = tiny_pair()
    target.config._name_or_path = str(tmp_path)  # as if loaded from that directory
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = target.generate(ids, assistant_model=draft, ssd=True, max_new_tokens=12, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain_generate(target, ids, max_new_tokens=12,
                                                     pad_token_id=target.generation_config.pad_token_id))
    assert out.ssd_stats["mode"] == tuned.mode and out.ssd_stats["controller"] is None  # nothing left to choose


def test_tune_tries_process_plans_where_a_kept_process_can_start(tmp_path, monkeypatch):
    """Where a kept draft process can be started, tune times the best SSD plan of each worker (thread and process);
    a written process plan runs on the draft's kept process."""
    from hf_ssd.workers import pool

    monkeypatch.setenv(pool.ENV, "1")
    try:
        assert main(["tune", "--tiny", "--out", str(tmp_path), "--modes", "ssd", "--prompts", "1",
                     "--max-new-tokens", "8", "--repeats", "1", "--top", "1"]) == 0
    finally:
        pool.close_all()
    table = json.loads((tmp_path / "ssd_tune.json").read_text())
    assert sorted(r["options"]["worker"] for r in table["tried"]) == ["process", "thread"]
    assert table["check"]["median_tok_s"] > 0
