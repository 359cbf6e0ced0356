"""deltaspec.engine: configs, models, weight loading, tokenizer, state pools, scheduler, runner,
and the Python APIs (sync `LLM`, asyncio `AsyncLLM`). Never imports deltaspec.server."""

from .async_llm import AsyncLLM
from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .errors import EngineDeadError, NonFiniteLogitsError, StepFailedError
from .model_config import ConfigError, ModelConfig
from .engine_config import EngineConfig
from .llm import LLM
from .prefix_cache import CheckpointHandle
from .request import CompletionOutput, Logprob, RequestDelta, RequestOutput, TokenLogprobs
from .sampling_params import SamplingParams
from .structured import Structured
from .tokenizer import TooManyTokensError
from .weights import WeightLoadError

__all__ = ["AsyncLLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CheckpointHandle",
           "CompletionOutput", "ConfigError", "EngineConfig", "EngineDeadError", "LLM", "Logprob", "ModelConfig",
           "NonFiniteLogitsError", "RequestDelta", "RequestOutput", "SamplingParams", "StepFailedError", "Structured",
           "TokenLogprobs", "TooManyTokensError", "WeightLoadError"]
