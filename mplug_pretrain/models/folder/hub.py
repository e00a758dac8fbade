"""Model folders on the Hugging Face Hub.

    MPLUG.from_pretrained("org/mplug-base-coco")   # a Hub id: huggingface_hub's cache (HF_HUB_OFFLINE=1 works)
    push_to_hub("runs/caption/model", "org/mplug-base-coco")

``resolve_model_folder`` turns a local folder or a Hub id into a folder on disk: an existing path is used as it
is; a name ``org/name`` that is not a path is fetched with ``huggingface_hub.snapshot_download`` into (or, offline,
found in) its cache. ``push_to_hub`` refreshes the model card, checks that the folder is self-contained (what
``mplug export`` / a run's ``model/`` hold) and uploads it with ``HfApi.upload_folder``.
"""
from __future__ import annotations

import os
import re

from mplug_pretrain.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what a folder needs to be used without this repository: weights, their config, the tokenizer, the transform
REQUIRED_FILES = ("config.json", "model.safetensors", "preprocessing.json", "vocab.txt", "README.md")


def resolve_model_folder(name_or_path: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    if os.path.exists(name_or_path) or not _HUB_ID.match(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    try:
        return snapshot_download(name_or_path, revision=revision, cache_dir=cache_dir)
    except LocalEntryNotFoundError as err:
        raise ConfigError(f"{name_or_path}: not a local folder, and not in the Hugging Face cache while offline "
                          f"(HF_HUB_OFFLINE=1 or no network): {err}") from err
    except RepositoryNotFoundError as err:
        raise ConfigError(f"{name_or_path}: not a local folder, and no such Hub repository: {err}") from err


def missing_files(folder: str) -> list[str]:
    return [name for name in REQUIRED_FILES if not os.path.isfile(os.path.join(folder, name))]


def push_to_hub(folder: str, repo_id: str, *, private: bool = False, token: str | None = None,
                commit_message: str | None = None, api=None) -> str:
    """Uploads a model folder to ``repo_id`` (created if absent) -> the commit URL. The model card is rewritten
    first (with the run's metrics when the folder is a run's ``model/``); a folder that is not self-contained
    (``REQUIRED_FILES``) is refused before any network call. ``api``: an ``HfApi`` (default: a new one)."""
    from mplug_pretrain.models.folder.model_card import write_model_card
    if not _HUB_ID.match(repo_id):
        raise ConfigError(f"repo_id: expected 'org/name', got {repo_id!r}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError(f"{folder}: not a model folder (no config.json)")
    write_model_card(folder, repo_id)
    missing = missing_files(folder)
    if missing:
        raise ConfigError(f"{folder}: not self-contained, missing {', '.join(missing)} (use a run's model/ "
                          "folder or `mplug export`, which write the tokenizer and preprocessing.json)")
    if api is None:
        from huggingface_hub import HfApi
        api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model",
                             commit_message=commit_message or f"Upload {os.path.basename(os.path.abspath(folder))}")
    return getattr(info, "commit_url", str(info))
