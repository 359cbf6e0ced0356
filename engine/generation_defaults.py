"""The checkpoint's sampling defaults: generation_config.json's values for the fields a request
leaves unset (SamplingParams.resolve).

`load` reads them from the checkpoint directory ("auto") or returns none ("none": every unset
field takes the built-in neutral value). Only the distribution fields are read (temperature,
top_p, top_k, min_p and the penalties), as vLLM does; eos_token_id is the tokenizer's business.
Knows nothing about requests.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from .sampling_params import BUILT_IN, SamplingParams

GenerationDefaults = Mapping[str, float | int]
SOURCES = ("auto", "none")


def load(model_dir: str | Path, source: str = "auto") -> GenerationDefaults:
    """The defaults of the checkpoint at model_dir (`source` "auto"), or none ("none"). A value
    out of range raises ValueError naming the file."""
    if source not in SOURCES:
        raise ValueError(f"generation_config must be one of {', '.join(SOURCES)}, got {source!r}")
    path = Path(model_dir) / "generation_config.json"
    if source == "none" or not path.is_file():
        return MappingProxyType({})
    config = json.loads(path.read_text())
    defaults = {name: config[name] for name in BUILT_IN if config.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error
    return MappingProxyType(defaults)
