"""bench/engine_throughput.py's roofline: the weight bytes it charges a decode step against the
step's own launch list (bench/decode_reads.py, which follows every read of the kernels), tied
and untied embeddings."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from decode_reads import decode_reads  # noqa: E402
from engine_throughput import step_weight_bytes  # noqa: E402
from spec_step import SHAPES  # noqa: E402

from deltaspec.engine import ModelConfig  # noqa: E402
from deltaspec.engine.models import HybridLM  # noqa: E402
from deltaspec.kernels import REFERENCE_OPS  # noqa: E402


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_step_weight_bytes_are_the_weights_the_step_reads(tied, batch):
    config = ModelConfig.from_dict({"model_type": "qwen3_5_text", **SHAPES["tiny"], "tie_word_embeddings": tied})
    with torch.device("meta"):
        model = HybridLM(config, REFERENCE_OPS, torch.bfloat16, with_mtp=False)
    read = sum(r.weight_bytes for r in decode_reads(config, batch, context=64))
    assert step_weight_bytes(model, batch) == read
    table, row = config.vocab_size * config.hidden_size * 2, config.hidden_size * 2
    stored = sum(p.nbytes for p in model.parameters())
    # An untied table is stored but never read whole: the step gathers the batch's rows of it.
    assert read - stored == batch * row - (0 if tied else table)
