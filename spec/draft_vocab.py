"""The reduced draft vocabulary's file format: `draft_vocab.json` in a checkpoint's directory.

    {"token_ids": [...most frequent first...], "calibration_files": N, "calibration_tokens": M}

With `draft_vocab_size=N` the MTP drafts only from the first N ids (an N x H draft head instead
of the full lm_head); verification still scores the full vocabulary, so output is unchanged.
bench/tools/draft_vocab.py writes the file from a calibration corpus. Knows nothing about how
the ids are used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

DRAFT_VOCAB_FILE = "draft_vocab.json"


def load_draft_vocab(model_path: Path, size: int) -> torch.Tensor:
    """The `size` most frequent token ids [size] int64 from the checkpoint's draft_vocab.json."""
    path = Path(model_path) / DRAFT_VOCAB_FILE
    try:
        token_ids = json.loads(path.read_text())["token_ids"]
    except FileNotFoundError:
        raise ValueError(f"draft_vocab_size={size} needs {path} (make it with bench/tools/draft_vocab.py)") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a draft vocabulary file: {e}") from None
    if len(token_ids) < size:
        raise ValueError(f"{path} lists {len(token_ids)} tokens, draft_vocab_size is {size}")
    return torch.tensor(token_ids[:size], dtype=torch.int64)


def write_draft_vocab(model_path: Path, ranked_token_ids: Sequence[int], calibration_files: int,
                      calibration_tokens: int) -> Path:
    """Write the file from token ids ranked by frequency (most frequent first); returns its path."""
    path = Path(model_path) / DRAFT_VOCAB_FILE
    path.write_text(json.dumps({"token_ids": list(ranked_token_ids), "calibration_files": calibration_files,
                                "calibration_tokens": calibration_tokens}))
    return path
