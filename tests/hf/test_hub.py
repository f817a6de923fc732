"""SSDConfig files and the Hub: round trips, versions, unknown keys, bad values, generation_config.json, push."""
from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_ssd  # noqa: F401
from hf_ssd import SSDConfig
from hf_ssd.hf import hub
from hf_ssd.config import CONFIG_NAME, CONFIG_VERSION
from hf_ssd.testing import tiny_pair


def test_round_trip_dir_and_file(tmp_path):
    cfg = SSDConfig(mode="sync", num_draft_tokens=3, fanout=[2, 1, 1, 0], downweight=0.5)
    path = cfg.save_pretrained(tmp_path)
    assert SSDConfig.from_pretrained(tmp_path) == cfg
    assert SSDConfig.from_pretrained(path) == cfg
    assert json.loads(open(path).read())["version"] == CONFIG_VERSION


def test_unknown_key_errors(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"mode": "ssd", "num_drafts": 4}))
    with pytest.raises(ValueError, match="unknown SSD config keys.*num_drafts"):
        SSDConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("bad, match", [
    ({"mode": "fast"}, "ssd_mode"), ({"num_draft_tokens": 0}, "num_draft_tokens"), ({"downweight": 1.5}, "downweight"),
    ({"num_draft_tokens": 2, "fanout": [1, 1]}, "fanout"), ({"alpha": 1.0}, "alpha"), ({"backup": "x"}, "backup"),
])
def test_bad_values_error(tmp_path, bad, match):
    (tmp_path / CONFIG_NAME).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match):
        SSDConfig.from_pretrained(tmp_path)


def test_versions(tmp_path):
    f = tmp_path / CONFIG_NAME
    f.write_text(json.dumps({"mode": "sync"}))  # no version: the current one
    assert SSDConfig.from_pretrained(f).version == CONFIG_VERSION
    f.write_text(json.dumps({"mode": "sync", "version": CONFIG_VERSION + 1}))
    with pytest.raises(ValueError, match="upgrade hf_ssd"):
        SSDConfig.from_pretrained(f)
    f.write_text(json.dumps({"mode": "sync", "version": 0}))
    with pytest.raises(ValueError, match="version 0 is not valid"):
        SSDConfig.from_pretrained(f)


def test_old_version_migrates_or_fails(monkeypatch):
    monkeypatch.setattr(hub, "CONFIG_VERSION", 3)  # pretend we are at version 3 with one migration 2 -> 3
    monkeypatch.setitem(hub.MIGRATIONS, 2, lambda d: {**{k: v for k, v in d.items() if k != "k"},
                                                      "num_draft_tokens": d["k"]})
    assert hub.upgrade({"version": 2, "k": 5}) == {"version": 3, "num_draft_tokens": 5}
    with pytest.raises(ValueError, match="version 1, which this hf_ssd can no longer read"):
        hub.upgrade({"version": 1})


def test_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither ssd_config.json"):
        SSDConfig.from_pretrained(tmp_path)


def test_from_hub_repo_id_uses_hf_hub_download(tmp_path, monkeypatch):
    SSDConfig(num_draft_tokens=6).save_pretrained(tmp_path)
    calls = []

    def fake_download(repo_id, filename, **kw):
        calls.append((repo_id, filename))
        return str(tmp_path / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    assert SSDConfig.from_pretrained("someone/ssd-config").num_draft_tokens == 6
    assert calls == [("someone/ssd-config", CONFIG_NAME)]


def test_push_to_hub_with_mocked_api():
    api = mock.MagicMock()
    cfg = SSDConfig(mode="sync", num_draft_tokens=5)
    cfg.push_to_hub("me/ssd", api=api, private=True)
    api.create_repo.assert_called_once_with("me/ssd", private=True, exist_ok=True, repo_type="model")
    kw = api.upload_file.call_args.kwargs
    assert kw["repo_id"] == "me/ssd" and kw["path_in_repo"] == CONFIG_NAME
    assert SSDConfig.from_dict(json.loads(kw["path_or_fileobj"])) == cfg
    with mock.patch("huggingface_hub.HfApi") as cls:  # default: HfApi(token=...)
        cfg.push_to_hub("me/ssd", token="t")
        cls.assert_called_once_with(token="t")
        cls.return_value.upload_file.assert_called_once()


@pytest.mark.parametrize("holder", ["draft", "target"])
def test_generate_picks_config_from_saved_model(tmp_path, holder):
    target, draft, tok = tiny_pair()
    model = draft if holder == "draft" else target
    hub.attach_to_model(SSDConfig(mode="sync", num_draft_tokens=2), model)
    model.save_pretrained(tmp_path)
    assert "ssd_config" in json.loads((tmp_path / "generation_config.json").read_text())
    assert SSDConfig.from_pretrained(tmp_path).mode == "sync"  # read from generation_config.json
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    if holder == "draft":
        draft = reloaded
    else:
        target = reloaded
    ids = torch.tensor([[5, 6, 7, 8]])
    out = target.generate(ids, assistant_model=draft, ssd=True, max_new_tokens=8, do_sample=False,
                          return_dict_in_generate=True)
    assert out.ssd_stats["mode"] == "sync"  # the config from the model dir, not the controller's choice
    out = target.generate(ids, assistant_model=draft, ssd=True, ssd_config=SSDConfig(mode="ssd"), max_new_tokens=8,
                          do_sample=False, return_dict_in_generate=True)
    assert out.ssd_stats["mode"] == "ssd"  # an explicit config wins
