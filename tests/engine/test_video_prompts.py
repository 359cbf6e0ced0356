"""Video input end to end on a tiny random Qwen3.5 vision-language checkpoint (fixtures.
make_vision_checkpoint), against HF transformers' Qwen3_5ForConditionalGeneration as the oracle.

Contracts: a video's placeholder becomes vLLM's text (each temporal patch's time, then its tokens
between vision start and end), written here from vLLM's rule and tokenized apart;
the multimodal RoPE positions of a prompt with images and videos equal HF's get_rope_index (each
patch a grid of its own, as HF splits a video's grid); greedy generation with videos (alone,
beside images) equals HF's tokens with pixel_values_videos, log-probabilities within float32
rounding; lossless with MTP; LLM.chat's video parts (a data: URL of an encoded file, frames) give
what generate gives; the prefix cache tells videos apart; bad video input is a ValueError that
leaves the engine serving.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer

from deltaspec.engine import LLM, SamplingParams
from deltaspec.engine.vision.image import VideoInput
from deltaspec.engine.vision.prompt import PromptImages, expand_image_tokens, expand_video_tokens
import fixtures
from fixtures import (ASSISTANT_TURN as TURN_END, IMAGE_PLACEHOLDER as IMAGE, USER_TURN as USER,
                      VIDEO_PLACEHOLDER as VIDEO, hf_vision_model, make_vision_checkpoint)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vision_checkpoints(tmp_path_factory):
    return fixtures.vision_checkpoints(tmp_path_factory, seed=11)


@pytest.fixture(scope="module")
def vision_checkpoint(vision_checkpoints):
    return vision_checkpoints("qwen3_5")


def engine(path, **options) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", **{"num_draft_tokens": 0, **options})


def random_frames(rng: np.random.Generator, frames: int, height: int, width: int) -> np.ndarray:
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def encoded_video(frames: np.ndarray, fps: int = 4) -> bytes:
    """The frames as a lossless video file (FFV1 in Matroska), as a client would send one."""
    import av
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24").reformat(format="bgr0")))
        container.mux(stream.encode())
    return out.getvalue()


def hf_text(text: str, videos: list[VideoInput], num_tokens) -> str:
    """vLLM's Qwen3-VL prompt replacement (HF Qwen3VLProcessor's before transformers 5), written
    from its rule: each `<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal patch,
    `<t seconds>` (one decimal) and the patch's tokens between vision start and end."""
    pieces = text.split(VIDEO)
    assert len(pieces) == len(videos) + 1
    out = pieces[0]
    for video, piece in zip(videos, pieces[1:]):
        for patch, seconds in zip(video.patches, video.timestamps):
            out += f"<{seconds:.1f} seconds><|vision_start|>" + "<|video_pad|>" * num_tokens(patch) + "<|vision_end|>"
        out += piece
    return out


def hf_inputs(llm: LLM, path, text: str, images: list, videos: list[VideoInput]) -> dict:
    """HF's model inputs for a prompt: ids tokenized apart (the checkpoint's tokenizer.json) from
    HF's expanded text, pixel values, grids (a video's grid (patches, h, w), as HF's processor
    gives it) and token types."""
    core = llm.core
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    resized = [core.image_processor.resize(image) for image in images]
    text = hf_text(text, videos, core.video_processor.num_tokens)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    ids = expand_image_tokens(ids, resized, core.model_config.image_token_id, core.image_processor.num_tokens)
    ids = torch.tensor([ids])
    kwargs = {"input_ids": ids,
              "mm_token_type_ids": (ids == core.model_config.image_token_id).int()
              + 2 * (ids == core.model_config.video_token_id).int()}
    if resized:
        kwargs |= dict(pixel_values=torch.cat([core.image_processor.patchify(r) for r in resized]),
                       image_grid_thw=torch.tensor([core.image_processor.grid_thw(r) for r in resized]))
    if videos:
        kwargs |= dict(pixel_values_videos=torch.cat([core.video_processor.patchify(p)
                                                      for v in videos for p in v.patches]),
                       video_grid_thw=torch.tensor([[len(v.patches), *core.video_processor.grid_thw(v.patches[0])[1:]]
                                                    for v in videos]))
    return kwargs


def hf_generate(hf, inputs: dict, max_tokens: int):
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]
    return tokens, logprobs


def test_video_placement_and_rope_match_hf(vision_checkpoint):
    """A video of 3 temporal patches between an image and text: the expanded prompt equals HF's
    text tokenized; positions and shift equal HF's get_rope_index."""
    llm = engine(vision_checkpoint)
    core, rng = llm.core, np.random.default_rng(1)
    video = core.video_processor.from_frames(random_frames(rng, 6, 64, 32), fps=2.0)
    assert len(video.patches) == 3 and video.timestamps == (0.25, 1.25, 2.25)
    image = core.image_processor.resize(Image.fromarray(random_frames(rng, 1, 48, 96)[0]))
    text = f"{USER}See {IMAGE} then {VIDEO}, done.{TURN_END}"
    inputs = hf_inputs(llm, vision_checkpoint, text, [Image.fromarray(image.array()[0])], [video])
    config = core.model_config
    expanded = expand_image_tokens(llm.tokenizer.encode(text), [image], config.image_token_id,
                                   core.image_processor.num_tokens)
    expanded = expand_video_tokens(expanded, [video], config.video_token_id, config.vision_start_token_id,
                                   config.vision_end_token_id, core.video_processor.num_tokens, llm.tokenizer.encode)
    assert expanded == inputs["input_ids"][0].tolist()
    assert expand_video_tokens(expanded, [video], config.video_token_id, config.vision_start_token_id,
                               config.vision_end_token_id, core.video_processor.num_tokens,
                               llm.tokenizer.encode) == expanded  # HF's form is taken as it is
    items = [image, *video.patches]
    grids = [core.image_processor.grid_thw(image)] + [core.video_processor.grid_thw(p) for p in video.patches]
    placed = PromptImages.place(expanded, items, grids, 2, config.image_token_id, config.video_token_id)
    hf = hf_vision_model(vision_checkpoint)
    positions, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               image_grid_thw=inputs["image_grid_thw"],
                                               video_grid_thw=inputs["video_grid_thw"])
    assert np.array_equal(placed.positions, positions[:, 0].numpy())
    assert placed.delta == int(delta) and placed.delta != 0


@pytest.mark.parametrize("family, num_draft_tokens", [("qwen3_5", 0), ("qwen3_5", 2), ("qwen3_5_moe", 0)])
def test_generation_with_videos_matches_hf(vision_checkpoints, family, num_draft_tokens):
    """A batch of a video prompt, an image-and-video prompt and a text prompt: greedy tokens equal
    HF's, log-probabilities within float32 rounding (plain); speculation emits the same tokens."""
    rng = np.random.default_rng(2)
    path = vision_checkpoints(family)
    hf = hf_vision_model(path)
    llm = engine(path, num_draft_tokens=num_draft_tokens)
    processor = llm.core.video_processor
    first = processor.from_frames(random_frames(rng, 8, 48, 64), fps=4.0)
    second = processor.from_frames(random_frames(rng, 3, 64, 40), fps=1.0)
    image = Image.fromarray(random_frames(rng, 1, 64, 64)[0])
    prompts = [(f"{USER}What happens in {VIDEO}?{TURN_END}", [], [first]),
               (f"{USER}Is {IMAGE} in {VIDEO}?{TURN_END}", [image], [second]),
               (f"{USER}No video here.{TURN_END}", [], [])]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images, "video": videos}}
                            for text, images, videos in prompts], params, use_tqdm=False)
    for (text, images, videos), output in zip(prompts, outputs):
        inputs = hf_inputs(llm, path, text, images, videos)
        assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
        tokens, logprobs = hf_generate(hf, inputs, 8)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, text
        if not num_draft_tokens:
            ours = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
            assert np.allclose(ours, logprobs, atol=2e-4), (ours, logprobs)


def test_llm_chat_reads_video_parts(vision_checkpoint):
    """LLM.chat's video parts, a data: URL of an encoded file and frames given as an array, render
    as the template's placeholder and give what generate gives for the decoded videos."""
    rng = np.random.default_rng(3)
    frames = random_frames(rng, 6, 48, 48)
    url = "data:video/x-matroska;base64," + base64.b64encode(encoded_video(frames, fps=4)).decode()
    other = random_frames(rng, 4, 32, 64)
    llm = engine(vision_checkpoint)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    messages = [{"role": "user", "content": [{"type": "text", "text": "A "},
                                             {"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": " and "},
                                             {"type": "video", "video": (other, {"fps": 2.0})}]}]
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    processor = llm.core.video_processor
    decoded = processor.decode(base64.b64decode(url.partition(",")[2]))
    assert len(decoded.patches) == 2  # 6 frames at 4 fps: 1.5 s at 2 fps, 3 frames, padded to 4
    direct = llm.generate({"prompt": f"{USER}A {VIDEO} and {VIDEO}<|im_end|>\n<|im_start|>assistant\n",
                           "multi_modal_data": {"video": [decoded, processor.from_frames(other, fps=2.0)]}},
                          params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_prefix_cache_tells_videos_apart(vision_checkpoint):
    """A text prefix of 64+ tokens, then a video of two patches: the same video restores past it;
    a video that differs in its second patch only restores up to that patch (the last checkpoint
    before it, past the first patch here) and generates what a fresh engine does."""
    rng = np.random.default_rng(5)
    frames = random_frames(rng, 4, 32, 32)
    changed = frames.copy()
    changed[3] = 255 - changed[3]
    llm = engine(vision_checkpoint, checkpoint_interval=64, block_size=16)
    processor = llm.core.video_processor
    text = f"{USER}{'The quick brown fox jumps over the lazy dog. ' * 6}{VIDEO} describe it.{TURN_END}"
    video_start = llm.tokenizer.encode(text).index(llm.core.model_config.video_token_id)
    assert video_start >= 64
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(llm, frames):
        video = processor.from_frames(frames, fps=2.0)
        return llm.generate({"prompt": text, "multi_modal_data": {"video": video}}, params, use_tqdm=False)[0]

    run(llm, frames)
    again = run(llm, frames)
    assert again.num_cached_tokens > len(again.prompt_token_ids) - 8
    swapped = run(llm, changed)
    video_tokens = np.flatnonzero(np.array(swapped.prompt_token_ids) == llm.core.model_config.video_token_id)
    second_patch = video_tokens[processor.num_tokens(processor.from_frames(frames, fps=2.0).patches[0])]
    assert video_start < second_patch // 64 * 64 == swapped.num_cached_tokens
    assert swapped.outputs[0].token_ids == run(engine(vision_checkpoint), changed).outputs[0].token_ids


def test_bad_video_input_is_refused(vision_checkpoint, checkpoint):
    rng = np.random.default_rng(6)
    llm = engine(vision_checkpoint)
    video = llm.core.video_processor.from_frames(random_frames(rng, 4, 32, 32), fps=2.0)
    with pytest.raises(ValueError, match="video tokens"):
        llm.generate({"prompt": f"{USER}{VIDEO}{VIDEO}{TURN_END}", "multi_modal_data": {"video": video}})
    with pytest.raises(ValueError, match="no videos were given"):
        llm.generate(f"{USER}{VIDEO}{TURN_END}")
    with pytest.raises(ValueError):
        llm.generate({"prompt": f"{USER}{VIDEO}{TURN_END}", "multi_modal_data": {"video": b"not a video"}})
    with pytest.raises(ValueError, match="VideoInput"):
        llm.core.add_request(f"{USER}{VIDEO}{TURN_END}", SamplingParams(), videos=[video.patches[0]])
    with pytest.raises(ValueError, match="image"):
        llm.core.add_request(f"{USER}{IMAGE}{TURN_END}", SamplingParams(), images=[video.patches[0]])
    assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="reads no images"):
        engine(checkpoint("qwen3_5")).generate({"prompt": "look", "multi_modal_data": {"video": video}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_videos_through_the_gpu_graphs(tmp_path_factory):
    """On the GPU (float32), decode and speculative steps in CUDA graphs: the CPU reference's
    tokens (which equal HF's above), plain and with MTP drafts, video and image-and-video prompts
    beside a text one in one batch."""
    from fixtures import GPU_SHAPE
    path = make_vision_checkpoint(tmp_path_factory.mktemp("video_gpu"), seed=13, **GPU_SHAPE)
    rng = np.random.default_rng(14)
    prompts = [{"prompt": f"{USER}Clip {i}: {VIDEO}, then {IMAGE}.{TURN_END}",
                "multi_modal_data": {"video": (random_frames(rng, 4 + 2 * i, 32 + 16 * i, 48), {"fps": 2.0}),
                                     "image": Image.fromarray(random_frames(rng, 1, 64, 48)[0])}}
               for i in range(3)]
    prompts += [{"prompt": f"{USER}Eight frames: {VIDEO}{TURN_END}",
                 "multi_modal_data": {"video": random_frames(rng, 8, 48, 64)}},
                f"{USER}Only text.{TURN_END}"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    reference = engine(path).generate(prompts, params, use_tqdm=False)
    for k in (0, 2):
        gpu = LLM(str(path), device="cuda", dtype="float32", num_draft_tokens=k, adaptive_draft_length=False)
        for ours, theirs in zip(gpu.generate(prompts, params, use_tqdm=False), reference):
            assert ours.prompt_token_ids == theirs.prompt_token_ids
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids, (k, ours.prompt)
        gpu.close()


def test_vllm_video_settings_reach_the_video_processor(vision_checkpoint, monkeypatch):
    """vLLM's engine-wide video settings: LLM(mm_processor_kwargs={"fps": ..}) samples the
    engine's videos; --media-io-kwargs '{"video": {"num_frames": -1}}' (Qwen3.5's model card)
    changes nothing, num_frames N takes N frames, and with --mm-processor-kwargs they meet in
    EngineConfig.video_options; settings that cannot hold are refused by name."""
    from deltaspec.server import cli
    frames = random_frames(np.random.default_rng(7), 8, 32, 32)
    assert len(engine(vision_checkpoint, mm_processor_kwargs={"fps": 0.5}).core.video_processor.from_frames(
        frames, fps=2.0).patches) == 1  # 4 s at 0.5 fps: 2 frames (min_frames), one patch
    served = {}

    async def serve(engine_config, server_config, single_process=False):
        served["engine"] = engine_config

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **options: None)
    for flags, options in ((['{"video": {"num_frames": -1}}'], None), (['{"video": {"num_frames": 6}}'],
                                                                      {"num_frames": 6}),
                           (['{"video": {"num_frames": -1}}', "--mm-processor-kwargs", '{"fps": 1}'], {"fps": 1})):
        assert cli.main(["serve", str(vision_checkpoint), "--media-io-kwargs", *flags]) == 0
        assert served["engine"].video_options == options
    with pytest.raises(ValueError, match=r"media_io_kwargs takes"):
        engine(vision_checkpoint, media_io_kwargs={"audio": {}})
    with pytest.raises(ValueError, match=r"set the video's \['num_frames'\] differently"):
        engine(vision_checkpoint, media_io_kwargs={"video": {"num_frames": 4}}, mm_processor_kwargs={"num_frames": 6})
