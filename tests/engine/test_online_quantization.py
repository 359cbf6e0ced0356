"""Online FP8 (`EngineConfig.quantization="fp8"`, engine/online_quantization.py): an unquantized
tiny checkpoint quantized while it loads holds, bit for bit, what the official-layout FP8
checkpoint of the same weights holds (tests/fixtures.py quantizes that one offline with its own
block quantizer), and generates the same greedy tokens; experts stored per expert or fused over
all experts alike. Combining it with an FP8 checkpoint, or asking for another method, fails."""

import pytest
import torch

from deltaspec.engine import LLM, ConfigError, EngineConfig, SamplingParams
from deltaspec.kernels.fp8 import FP8

from harness import generate


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("family, moe_layout", [("qwen3_5", "per_expert"), ("qwen3_5_moe", "fused"),
                                                ("qwen3_next", "per_expert")])
def test_online_fp8_equals_the_offline_checkpoint(checkpoint, family, moe_layout):
    plain = checkpoint(family, dtype=torch.bfloat16, moe_layout=moe_layout)
    offline = LLM(checkpoint(family, dtype=torch.bfloat16, fp8=True))
    online = LLM(plain, quantization="fp8")
    expected, actual = dict(offline.model.named_parameters()), dict(online.model.named_parameters())
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype and torch.equal(bits(actual[name]), bits(value)), name
    assert sum(p.dtype == FP8 for p in actual.values()) > 0
    if family == "qwen3_5_moe":   # one family generates (the CPU reference is slow)
        batch, params = [[5, 17, 300, 2], [9] * 11], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        tokens = generate(online.core, batch, params)
        assert tokens == generate(offline.core, batch, params) and all(len(t) == 6 for t in tokens)


def test_online_fp8_refuses_a_quantized_checkpoint_and_other_methods(checkpoint):
    with pytest.raises(ConfigError) as error:
        LLM(checkpoint("qwen3_5", fp8=True), quantization="fp8")
    assert "already block-FP8" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="quantization must be 'fp8'"):
        EngineConfig(model=".", quantization="int4")
