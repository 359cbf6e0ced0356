"""The vision encoder (engine/vision/encoder.py) against HF transformers' Qwen3_5VisionModel, side
by side on one GPU, at the published Qwen3.5 tower (27 blocks of 1152, 16 heads, merger to the
9B's 4096) in bf16, with the same random weights.

    source bench/tools/device_setup.sh && python3 bench/vision_encoder.py [--sides 448,1024,2048]
        [--videos 10x704x1280,30x480x864] [--out DIR]

For square images of each side (pixels; patch 16, merge 2: side^2 / 1024 LLM tokens), one image
and a batch of four: ms per encode (the median of eager_time_us' rounds after a warm-up, as the
runner calls it: patches on the device, SDPA per frame), images per second, the LLM tokens the
encode yields per second, and the largest difference from HF's output (bf16: a few ulps). For
videos (temporal patches x height x width in pixels: 30x480x864 is 30 s sampled at 2 fps and
resized as Qwen3.5's processor does), ours encodes the patches as the runner does, one grid
(1, h, w) each, HF the video's grid (t, h, w): the same outputs. Writes vision_encoder-<gpu>.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import eager_time_us, write_result
from deltaspec.engine.vision.encoder import VisionConfig, VisionEncoder

QWEN3_5_VISION = {"depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
                  "intermediate_size": 4304, "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096,
                  "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}


def hf_encoder(config: dict):
    import transformers
    model = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(
        transformers.Qwen3_5VisionConfig(**config, _attn_implementation="sdpa"))
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", default="448,1024,2048")
    parser.add_argument("--videos", default="10x704x1280,30x480x864")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    hf = hf_encoder(QWEN3_5_VISION)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.normal_(0, 0.02)
    config = VisionConfig.from_dict(QWEN3_5_VISION)
    ours = VisionEncoder(config, torch.bfloat16, "cuda")
    names = ours.checkpoint_names()
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            if name in names:
                params[names[name].parameter].copy_(tensor.reshape(params[names[name].parameter].shape))
    def compare(ours_grids: list, hf_grids: list, **row) -> None:
        patches = torch.randn(sum(t * h * w for t, h, w in ours_grids), config.patch_dim, device="cuda")
        grid_thw = torch.tensor(hf_grids, device="cuda")
        with torch.inference_mode():
            ours_ms = eager_time_us(lambda _: ours(patches, ours_grids), 1) / 1000
            hf_ms = eager_time_us(lambda _: hf(patches.bfloat16(), grid_thw=grid_thw), 1) / 1000
            diff = (ours(patches, ours_grids).float() - hf(patches.bfloat16(), grid_thw=grid_thw).pooler_output.float())
        tokens = len(patches) // 4
        rows.append(dict(**row, llm_tokens=tokens, ours_ms=round(ours_ms, 3), hf_ms=round(hf_ms, 3),
                         speedup=round(hf_ms / ours_ms, 3), tokens_per_s=round(tokens / ours_ms * 1000),
                         max_abs_diff=round(diff.abs().max().item(), 4)))
        print(rows[-1])

    rows = []
    for side in (int(s) for s in args.sides.split(",")):
        grid = (1, side // 16, side // 16)
        for count in (1, 4):
            compare([grid] * count, [grid] * count, side=side, images=count)
    for video in filter(None, args.videos.split(",")):
        t, height, width = (int(v) for v in video.split("x"))
        compare([(1, height // 16, width // 16)] * t, [(t, height // 16, width // 16)], video=video)
    write_result(args.out, "vision_encoder", torch.cuda.get_device_name(), {"config": QWEN3_5_VISION, "rows": rows})


if __name__ == "__main__":
    main()
