"""Launches per decode step, counted on the CPU (tests/launch_count.py) through the GPU kernel
table in the interpreter: the fused table saves exactly the launches its fused entries fold
away (per layer: SwiGLU into the down projection; the gated norm into out_proj (GDN) or the KV
write into q/k norm + RoPE (attention); both residual add + RMSNorms into the epilogues of the
projections before them), and what a step launches is pinned per kernel, so a change that
adds launches to the decode path shows here before it shows in bench/profile_step.py on a GPU.
And the fused table, drafting and verifying, keeps greedy output lossless."""

import pytest
import torch

from deltaspec.engine import LLM, SamplingParams
from deltaspec.engine.decode_step import DecodeRow, DecodeStep
from deltaspec.kernels.backend import triton_ops, unfused_triton_ops
from launch_count import count_launches


def step_launches(core, ops, num_rows: int):
    """The launches of one plain decode step of num_rows rows (slots 1.., positions mid-block),
    after one uncounted step (made once: the step's constants and the RoPE tables)."""
    step = DecodeStep(core.model, core.states, core.kv, 16, False, num_rows, 4)
    rows = [DecodeRow(1 + r, 7 + r, 20 + r, (1 + 2 * r, 2 + 2 * r)) for r in range(num_rows)]
    device_rows = step.row_tensors(rows, torch.device("cpu"))
    core.model.ops = ops
    with torch.inference_mode():
        step.plain(device_rows)
        with count_launches() as launches:
            step.plain(device_rows)
    return launches


def test_fused_decode_step_saves_its_launches(checkpoint):
    core = LLM(checkpoint("qwen3_5"), num_draft_tokens=0, kernel_backend="triton", max_num_seqs=4).core
    config = core.model.config
    num_layers = config.num_hidden_layers
    num_gdn = config.layer_types.count("linear_attention")
    num_attention = num_layers - num_gdn
    fused = step_launches(core, triton_ops(), 2)
    unfused = step_launches(core, unfused_triton_ops(), 2)
    assert fused.torch_ops == unfused.torch_ops
    assert unfused.total - fused.total == 4 * num_layers
    for kernel, count in (("_silu_and_mul_kernel", num_layers), ("_gated_rms_norm_kernel", num_gdn),
                          ("_write_kv_kernel", num_attention)):
        assert kernel not in fused.kernels and unfused.kernels[kernel] == count, kernel
    assert unfused.kernels["_rms_norm_kernel"] == 2 * num_layers + 1
    # Per layer: four projections (in_proj or qkv, out_proj or o_proj with the post-mixer norm,
    # gate_up, down with the next input norm); GDN: conv, recurrence; attention: q/k norm +
    # RoPE + KV write, attention (short contexts: not split over the key range). Plus the
    # embedding's norm.
    assert fused.kernels["_linear_kernel"] == 4 * num_layers
    assert fused.kernels["_rms_norm_kernel"] == 1
    assert fused.kernels["_conv_decode_kernel"] == fused.kernels["_gdn_decode_kernel"] == num_gdn
    assert sum(fused.kernels.values()) == 4 * num_layers + 1 + 2 * num_gdn + 2 * num_attention


@pytest.mark.slow
def test_fused_table_speculates_losslessly(checkpoint):
    """Greedy output through the fused Triton table with MTP drafts (draft and verify batches
    take the fused prologues and the norm epilogue) equals the reference table's plain output."""
    path, prompts = checkpoint("qwen3_5"), [[1 + i for i in range(n)] for n in (5, 9)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = LLM(path, num_draft_tokens=0, max_num_seqs=4).generate(prompts, params)
    fused = LLM(path, kernel_backend="triton", num_draft_tokens=2, max_num_seqs=4).generate(prompts, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
