"""deltaspec.engine: configs, models, weight loading, tokenizer, state pools and the Python API.

Never imports deltaspec.server."""

from .config import ConfigError, ModelConfig
from .llm import LLM, RequestOutput
from .sampling_params import SamplingParams
from .weights import WeightLoadError

__all__ = ["LLM", "ConfigError", "ModelConfig", "RequestOutput", "SamplingParams", "WeightLoadError"]
