"""Where a checkpoint comes from: a local directory, or a Hugging Face Hub repo id (vLLM's model
argument, `Qwen/Qwen3.5-9B`), downloaded into the Hub's cache, or found there, by huggingface_hub.

`resolve_model` turns the argument into the directory every loader reads (config, tokenizer,
generation config, weights). The Hub's own settings apply as they do for vLLM and transformers:
HF_HOME / HF_HUB_CACHE (where the cache is; `download_dir` overrides it), HF_TOKEN (private and
gated repos), HF_HUB_OFFLINE=1 (the cache only, no request leaves), HF_ENDPOINT (a mirror).
Only the files a checkpoint is read from are fetched: `CHECKPOINT_FILES`. Knows nothing about
what the files hold.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from .engine_config import EngineConfig

# What the loaders read: config.json, generation_config.json, tokenizer.json and its config,
# chat_template.jinja, the safetensors shards and their index (draft_vocab.json is ours).
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt")


def resolve_model(model: str | Path, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The local checkpoint directory for `model`: itself when it is a directory, else the Hub
    snapshot of the repo it names at `revision` (a branch, tag or commit; default main),
    downloaded with progress bars unless the cache holds it. ValueError or FileNotFoundError
    with one line saying what is wrong (no such directory, no such repo or revision, a gated
    repo without a token, offline and not cached)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None or download_dir is not None:
            raise ValueError(f"model {str(model)!r} is a local directory: revision and download_dir apply to "
                             f"Hugging Face Hub repo ids only")
        return _checkpoint(path)
    text = str(model)
    if path.exists() or _looks_like_path(text):
        raise FileNotFoundError(f"no checkpoint directory at {text}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(text)
    except HFValidationError:
        raise FileNotFoundError(f"model {text!r} is neither a directory nor a Hugging Face Hub repo id "
                                f"(namespace/name)") from None
    try:
        snapshot = Path(snapshot_download(text, revision=revision, cache_dir=download_dir,
                                          allow_patterns=list(CHECKPOINT_FILES)))
    except GatedRepoError:
        raise ValueError(f"model {text!r} is a gated repo: accept its terms on huggingface.co and set HF_TOKEN "
                         f"(or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ValueError(f"model {text!r} has no revision {revision!r} on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model {text!r}: no such directory, and no such repo on the Hugging Face Hub (a "
                                f"private repo needs HF_TOKEN)") from None
    except IncompleteSnapshotError as error:    # a download cut short, then offline
        raise FileNotFoundError(f"model {text!r}: {error}") from None
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if _offline() else "the Hugging Face Hub could not be reached"
        raise FileNotFoundError(f"model {text!r} at revision {revision or 'main'} is not in the Hub cache "
                                f"({download_dir or 'HF_HOME'}) and {offline}") from None
    return _checkpoint(snapshot)


def _checkpoint(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path}: no config.json (pass an HF-format checkpoint's directory or "
                                f"a Hugging Face Hub repo id)")
    return path


def local_config(config: EngineConfig) -> EngineConfig:
    """config with `model` resolved to its local directory (resolve_model), so that the processes
    an engine starts read it from disk without asking the Hub again, and device and dtype "auto"
    made concrete for the checkpoint (EngineConfig.concrete)."""
    path = resolve_model(config.model, config.revision, config.download_dir)
    return replace(config, model=path, revision=None, download_dir=None).concrete(_stored_dtype(path))


def _stored_dtype(path: Path) -> str | None:
    """The dtype config.json says the weights are stored in (transformers' `dtype`, formerly
    `torch_dtype`; a multimodal checkpoint's in text_config)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the config's own loader reports it
    for section in (raw, raw.get("text_config") or {}):
        dtype = section.get("dtype") or section.get("torch_dtype")
        if isinstance(dtype, str):
            return dtype
    return None


def _looks_like_path(text: str) -> bool:
    """A filesystem path rather than a repo id: absolute, home- or dot-relative, more than one
    separator (a repo id has at most one '/'), or Windows-style."""
    return (os.path.isabs(text) or text.startswith(("~", ".")) or text.count("/") > 1 or "\\" in text)


def _offline() -> bool:
    from huggingface_hub import constants
    return constants.HF_HUB_OFFLINE
