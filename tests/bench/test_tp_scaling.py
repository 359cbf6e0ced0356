"""The Qwen3.5-122B-A10B shape bench/tp_scaling.py runs at tp=4: its size (the published
~233 GiB in bf16 with the MTP layer) and each rank's share, counted on the meta device (nothing
is allocated). Every weight is some rank's, and a rank's share fits one H100 (~79 GiB) with room
for the pools."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from spec_e2e import COMMON, SHAPES  # noqa: E402

from deltaspec.engine import ModelConfig  # noqa: E402
from deltaspec.engine.models import HybridLM  # noqa: E402
from deltaspec.engine.sharding import shard_config  # noqa: E402
from deltaspec.engine.tensor_parallel import TensorParallel  # noqa: E402
from deltaspec.kernels import REFERENCE_OPS  # noqa: E402


def num_parameters(config: ModelConfig, tp: TensorParallel | None = None) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in HybridLM(config, REFERENCE_OPS, torch.bfloat16, with_mtp=True, tp=tp).parameters())


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_122b_shape_and_its_four_rank_shards(expert_parallel):
    config = ModelConfig.from_dict({**COMMON, **SHAPES["122b-a10b"]})
    # By hand: 48 MoE layers of 256 experts x 3 x 3072 x 1024 (115.96B), their shared experts and
    # routers (0.49B), 36 GDN layers (3.19B), 12 attention layers (0.94B), embeddings and lm_head
    # (1.53B): 122.1B; the MoE MTP layer adds 2.5B.
    total = num_parameters(config)
    assert 124.5e9 < total < 124.8e9 and 231 < total * 2 / 2**30 < 234
    shares = [num_parameters(shard_config(config, 4, rank, expert_parallel), TensorParallel(rank, 4, torch.device("meta")))
              for rank in range(4)]
    assert sum(shares) >= total  # replicated norms, routers and the MTP fc count on every rank
    for share in shares:
        assert share * 2 / 2**30 < 60  # bf16 GiB: about a quarter, ~20 GiB of an H100 left for the pools


@pytest.mark.slow
def test_serve_smoke_on_the_cpu(tmp_path):
    """bench/tools/serve_smoke.py at tp=2 on the CPU (gloo): the server starts, streams a
    completion, stops on SIGINT and leaves no process; the GPU run uses the same script."""
    script = Path(__file__).resolve().parents[2] / "bench" / "tools" / "serve_smoke.py"
    subprocess.run([sys.executable, str(script), "--device", "cpu", "--shape", "tiny", "--tp", "2",
                    "--out", str(tmp_path)], check=True, timeout=600, capture_output=True)
    report = json.loads((tmp_path / "serve_smoke-cpu-tiny-tp2.json").read_text())
    assert report["ok"] and not report["processes_left"] and report["exit_code"] == 0
    assert report["completion"]["chunks"] > 0 and report["completion"]["text"]
