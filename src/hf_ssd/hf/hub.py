"""SSDConfig on disk and on the Hugging Face Hub: its own `ssd_config.json`, or the `ssd_config` key of a model's
`generation_config.json` (what `generate(..., ssd=True)` reads from the draft, then the target).

Versioned: a file without `version` is version 1; an older version is upgraded by the migrations below (none are
needed yet) or refused with a clear error; a newer one asks to upgrade hf_ssd.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from hf_ssd.config import CONFIG_NAME, CONFIG_VERSION, SSDConfig

GENERATION_CONFIG_NAME = "generation_config.json"
GENERATION_CONFIG_KEY = "ssd_config"

# version -> function turning a dict of that version into a dict of version+1 (keys renamed, defaults filled).
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def upgrade(data: dict[str, Any], source: str = "SSD config") -> dict[str, Any]:
    """Bring a stored config dict up to CONFIG_VERSION, or raise a ValueError that says what to do."""
    data = dict(data)
    version = data.get("version", CONFIG_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{source}: version {version!r} is not valid; expected an integer >= 1")
    if version > CONFIG_VERSION:
        raise ValueError(f"{source} has version {version}, but this hf_ssd reads versions <= {CONFIG_VERSION}: "
                         "upgrade hf_ssd (pip install -U hf-ssd)")
    while version < CONFIG_VERSION:
        if version not in MIGRATIONS:
            raise ValueError(f"{source} has version {version}, which this hf_ssd can no longer read (no migration "
                             f"to version {version + 1}); re-create it with SSDConfig(...).save_pretrained()")
        data = MIGRATIONS[version](data)
        version += 1
        data["version"] = version
    return data


def config_from_dict(data: dict[str, Any], source: str = "SSD config") -> SSDConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(data).__name__}")
    try:
        return SSDConfig.from_dict(upgrade(data, source))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _from_directory(directory: Path) -> SSDConfig:
    own = directory / CONFIG_NAME
    if own.is_file():
        return config_from_dict(_read_json(own), str(own))
    gen = directory / GENERATION_CONFIG_NAME
    if gen.is_file():
        stored = _read_json(gen).get(GENERATION_CONFIG_KEY)
        if stored is not None:
            return config_from_dict(stored, f"{gen} (key {GENERATION_CONFIG_KEY!r})")
    raise FileNotFoundError(f"{directory} has neither {CONFIG_NAME} nor a {GENERATION_CONFIG_NAME} with an "
                            f"{GENERATION_CONFIG_KEY!r} key")


def from_pretrained(name_or_path: str | os.PathLike, *, revision: str | None = None, token: str | bool | None = None,
                    cache_dir: str | os.PathLike | None = None, local_files_only: bool = False) -> SSDConfig:
    """Load an SSDConfig from a directory, a JSON file, or a Hub repo id (ssd_config.json, else generation_config)."""
    path = Path(name_or_path)
    if path.is_dir():
        return _from_directory(path)
    if path.is_file():
        data = _read_json(path)
        if path.name == GENERATION_CONFIG_NAME:
            data = data.get(GENERATION_CONFIG_KEY)
            if data is None:
                raise ValueError(f"{path} has no {GENERATION_CONFIG_KEY!r} key")
        return config_from_dict(data, str(path))
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    kw = dict(revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only)
    try:
        file = hf_hub_download(str(name_or_path), CONFIG_NAME, **kw)
        return config_from_dict(_read_json(Path(file)), f"{name_or_path}/{CONFIG_NAME}")
    except EntryNotFoundError:
        pass
    try:
        file = hf_hub_download(str(name_or_path), GENERATION_CONFIG_NAME, **kw)
    except EntryNotFoundError:
        raise FileNotFoundError(f"Hub repo {name_or_path} has neither {CONFIG_NAME} nor {GENERATION_CONFIG_NAME}")
    stored = _read_json(Path(file)).get(GENERATION_CONFIG_KEY)
    if stored is None:
        raise FileNotFoundError(f"Hub repo {name_or_path}: {GENERATION_CONFIG_NAME} has no {GENERATION_CONFIG_KEY!r}")
    return config_from_dict(stored, f"{name_or_path}/{GENERATION_CONFIG_NAME}")


def push_to_hub(config: SSDConfig, repo_id: str, *, commit_message: str = "Upload SSD config",
                private: bool | None = None, token: str | bool | None = None, revision: str | None = None,
                create_pr: bool = False, api=None):
    """Upload `config` as `ssd_config.json` to a model repo (created if missing); returns the CommitInfo."""
    from huggingface_hub import HfApi

    config.validate()
    api = api if api is not None else HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_file(
        path_or_fileobj=config.to_json_string().encode(), path_in_repo=CONFIG_NAME, repo_id=repo_id,
        repo_type="model", revision=revision, commit_message=commit_message, create_pr=create_pr,
    )


def attach_to_model(config: SSDConfig, model) -> None:
    """Store `config` in `model.generation_config` so that `model.save_pretrained` writes it and
    `generate(..., ssd=True)` picks it up (from the draft first, then the target)."""
    config.validate()
    model.generation_config.ssd_config = config.to_dict()
    # A generation config derived from the model config (`_from_model_config=True`) drops unknown keys such as
    # ssd_config when it is loaded again; once it carries our key it is a user-edited config.
    model.generation_config._from_model_config = False
