"""Image input end to end on a tiny random Qwen3.5 vision-language checkpoint (fixtures.
make_vision_checkpoint), against HF transformers' Qwen3_5ForConditionalGeneration as the oracle.

Contracts: the prompt's multimodal RoPE positions and their shift equal HF's get_rope_index;
greedy generation with images (one or two a prompt, of different grids, beside a text prompt in
the same batch) equals HF's tokens, with log-probabilities within float32 rounding; lossless with
MTP speculation; the same when an image's tokens are split over prefill chunks; the prefix cache
restores a prompt only over equal images (a different image misses from its first token on);
bad image input is a ValueError that leaves the engine serving.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from deltaspec.engine import LLM, SamplingParams
from deltaspec.engine.vision.preprocess import ImageProcessor
from deltaspec.engine.vision.prompt import PromptImages, expand_image_tokens
import fixtures
from fixtures import (ASSISTANT_TURN as TURN_END, IMAGE_PLACEHOLDER as IMAGE, USER_TURN as USER,
                      hf_vision_model, make_vision_checkpoint)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vision_checkpoints(tmp_path_factory):
    return fixtures.vision_checkpoints(tmp_path_factory, seed=3)


@pytest.fixture(scope="module")
def vision_checkpoint(vision_checkpoints):
    return vision_checkpoints("qwen3_5")


@pytest.fixture(scope="module")
def hf_model(vision_checkpoint):
    return hf_vision_model(vision_checkpoint)


def random_image(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def engine(path, **options) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", **{"num_draft_tokens": 0, **options})


def hf_generate(hf, processor: ImageProcessor, token_ids: list[int], images: list, max_tokens: int):
    """HF's greedy tokens and their log-probabilities for the expanded prompt token_ids."""
    ids = torch.tensor([token_ids])
    kwargs = {}
    if images:
        resized = [processor.resize(image) for image in images]
        kwargs = dict(pixel_values=torch.cat([processor.patchify(r) for r in resized]),
                      image_grid_thw=torch.tensor([processor.grid_thw(r) for r in resized]),
                      mm_token_type_ids=(ids == processor.image_token_id).int())
    with torch.no_grad():
        out = hf.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]
    return tokens, logprobs


def test_rope_positions_match_hf(vision_checkpoint, hf_model):
    """Two images of different grids between text runs: PromptImages' positions and shift equal
    HF's get_rope_index."""
    processor = ImageProcessor.from_model_dir(vision_checkpoint)
    rng = np.random.default_rng(1)
    images = [processor.resize(random_image(rng, 64, 128)), processor.resize(random_image(rng, 96, 32))]
    pad = processor.image_token_id
    prompt = [7, 8, 9, pad, 11, 12, 13, 14, 15, pad, 17, 18]
    expanded = expand_image_tokens(prompt, images, pad, processor.num_tokens)
    placed = PromptImages.place(expanded, images, [processor.grid_thw(i) for i in images], 2, pad)
    ids = torch.tensor([expanded])
    positions, delta = hf_model.model.get_rope_index(ids, (ids == pad).int(),
                                                     image_grid_thw=torch.tensor(placed.grids))
    assert np.array_equal(placed.positions, positions[:, 0].numpy())
    assert placed.delta == int(delta) and placed.delta != 0
    assert np.array_equal(placed.rope_positions(len(expanded), len(expanded) + 3),
                          np.broadcast_to(np.arange(len(expanded), len(expanded) + 3) + placed.delta, (3, 3)))


@pytest.mark.parametrize("family, num_draft_tokens", [("qwen3_5", 0), ("qwen3_5", 2), ("qwen3_5_moe", 0),
                                                      ("qwen3_5_moe", 2)])
def test_generation_with_images_matches_hf(vision_checkpoints, family, num_draft_tokens):
    """A batch of three prompts (two images, one image, none): each prompt's greedy tokens equal
    HF's, their log-probabilities within float32 rounding (plain); speculation emits the same
    tokens (lossless). Dense and MoE (35B-A3B's kind) checkpoints."""
    rng = np.random.default_rng(2)
    path = vision_checkpoints(family)
    hf_model = hf_vision_model(path)
    llm = engine(path, num_draft_tokens=num_draft_tokens)
    prompts = [
        (f"{USER}Compare {IMAGE} with {IMAGE}, please.{TURN_END}", [random_image(rng, 64, 96), random_image(rng, 128, 40)]),
        (f"{USER}What is in {IMAGE}?{TURN_END}", [random_image(rng, 50, 70)]),
        (f"{USER}No picture here.{TURN_END}", []),
    ]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} if images else text
                            for text, images in prompts], params, use_tqdm=False)
    processor = llm.core.image_processor
    for (text, images), output in zip(prompts, outputs):
        expected_ids = expand_image_tokens(llm.tokenizer.encode(text), [processor.resize(i) for i in images],
                                           processor.image_token_id, processor.num_tokens)
        assert output.prompt_token_ids == expected_ids
        tokens, logprobs = hf_generate(hf_model, processor, expected_ids, images, 8)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, text
        if not num_draft_tokens:
            ours = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
            assert np.allclose(ours, logprobs, atol=2e-4), (ours, logprobs)


def test_image_split_over_prefill_chunks(vision_checkpoint):
    """Prefill chunks of 8 tokens cut the images' token runs: the same tokens and
    log-probabilities as one chunk."""
    rng = np.random.default_rng(4)
    prompt = {"prompt": f"{USER}Look {IMAGE} and {IMAGE}.{TURN_END}",
              "multi_modal_data": {"image": [random_image(rng, 96, 96), random_image(rng, 64, 64)]}}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    whole = engine(vision_checkpoint).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    chunked = engine(vision_checkpoint, max_num_batched_tokens=8, max_num_seqs=1).generate(
        prompt, params, use_tqdm=False)[0].outputs[0]
    assert chunked.token_ids == whole.token_ids
    assert np.allclose([e[t].logprob for e, t in zip(chunked.logprobs, chunked.token_ids)],
                       [e[t].logprob for e, t in zip(whole.logprobs, whole.token_ids)], atol=1e-5)


def test_prefix_cache_tells_images_apart(vision_checkpoint):
    """A text prefix of 64+ tokens, then an image: the same prompt with the same image restores
    past the image; with another image only the text before it (its last checkpoint, every 64
    tokens), and it generates what a fresh engine does with that image."""
    rng = np.random.default_rng(5)
    first, other = random_image(rng, 64, 64), random_image(rng, 64, 64)
    llm = engine(vision_checkpoint, checkpoint_interval=64, block_size=16)
    text = f"{USER}{'The quick brown fox jumps over the lazy dog. ' * 6}{IMAGE} describe it.{TURN_END}"
    image_start = llm.tokenizer.encode(text).index(llm.core.image_processor.image_token_id)
    assert image_start >= 64
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(image):
        return llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]

    run(first)
    again = run(first)
    assert again.num_cached_tokens > len(again.prompt_token_ids) - 8
    swapped = run(other)
    assert swapped.num_cached_tokens == image_start // 64 * 64
    fresh = engine(vision_checkpoint).generate({"prompt": text, "multi_modal_data": {"image": other}}, params,
                                               use_tqdm=False)[0]
    assert swapped.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_bad_image_input_is_refused(vision_checkpoint, checkpoint):
    rng = np.random.default_rng(6)
    image = random_image(rng, 64, 64)
    llm = engine(vision_checkpoint)
    with pytest.raises(ValueError, match="image tokens"):
        llm.generate({"prompt": f"{USER}{IMAGE}{IMAGE}{TURN_END}", "multi_modal_data": {"image": image}})
    with pytest.raises(ValueError, match="no images were given"):
        llm.generate(f"{USER}{IMAGE}{TURN_END}")
    with pytest.raises(ValueError, match="not an image"):
        llm.generate({"prompt": f"{USER}{IMAGE}{TURN_END}", "multi_modal_data": {"image": b"not a png"}})
    with pytest.raises(ValueError, match="images and videos"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": [image]}})
    # The engine still serves.
    assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="language model only"):
        engine(vision_checkpoint, language_model_only=True).generate(
            {"prompt": f"{USER}{IMAGE}{TURN_END}", "multi_modal_data": {"image": image}})
    with pytest.raises(ValueError, match="reads no images"):
        engine(checkpoint("qwen3_5")).generate({"prompt": "look", "multi_modal_data": {"image": image}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_images_through_the_gpu_graphs(tmp_path_factory):
    """On the GPU (float32), with decode and speculative steps in CUDA graphs reading each slot's
    RoPE shift: the CPU reference's tokens (which equal HF's above), plain and with MTP drafts,
    four image prompts and a text one in one batch."""
    from fixtures import GPU_SHAPE
    path = make_vision_checkpoint(tmp_path_factory.mktemp("vision_gpu"), seed=7, **GPU_SHAPE)
    rng = np.random.default_rng(8)
    prompts = [{"prompt": f"{USER}Picture {i}: {IMAGE} and {IMAGE}.{TURN_END}",
                "multi_modal_data": {"image": [random_image(rng, 32 + 16 * i, 96), random_image(rng, 64, 48)]}}
               for i in range(4)] + [f"{USER}Only text.{TURN_END}"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    reference = engine(path).generate(prompts, params, use_tqdm=False)
    for k in (0, 2):
        gpu = LLM(str(path), device="cuda", dtype="float32", num_draft_tokens=k, adaptive_draft_length=False)
        for ours, theirs in zip(gpu.generate(prompts, params, use_tqdm=False), reference):
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids, (k, ours.prompt)
        gpu.close()


def test_llm_chat_reads_image_parts(vision_checkpoint):
    """LLM.chat's image parts (a data: URL, a PIL image) render as the template's placeholder and
    give what generate gives for the same prompt and images (and for them as RGB arrays, as vLLM
    takes them); an ftp URL is refused by name."""
    import base64
    import io
    rng = np.random.default_rng(9)
    first, second = random_image(rng, 64, 80), random_image(rng, 48, 48)
    png = io.BytesIO()
    first.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    llm = engine(vision_checkpoint)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    messages = [{"role": "user", "content": [{"type": "text", "text": "A "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " and "},
                                             {"type": "image_pil", "image_pil": second}]}]
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    direct = llm.generate({"prompt": f"{USER}A {IMAGE} and {IMAGE}<|im_end|>\n<|im_start|>assistant\n",
                           "multi_modal_data": {"image": [first, second]}}, params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    arrays = llm.generate({"prompt": f"{USER}A {IMAGE} and {IMAGE}<|im_end|>\n<|im_start|>assistant\n",
                           "multi_modal_data": {"image": [np.asarray(first), np.asarray(second)]}}, params,
                          use_tqdm=False)[0]  # vLLM's arrays [height, width, 3]
    assert arrays.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match="RGB uint8"):
        llm.generate({"prompt": f"{USER}{IMAGE}{TURN_END}",
                      "multi_modal_data": {"image": np.zeros((8, 8), np.float32)}})
    with pytest.raises(ValueError, match="data: or http"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}])


def test_pixel_bounds_set_an_images_tokens(vision_checkpoint):
    """vLLM's mm_processor_kwargs (max_pixels) on LLM(...): a 128 x 128 image (16 tokens under the
    checkpoint's bounds) is resized to at most 64 x 64 pixels (4 tokens); a key the processor does
    not take is refused by name."""
    image = random_image(np.random.default_rng(10), 128, 128)
    prompt = {"prompt": f"{USER}{IMAGE}{TURN_END}", "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=1)
    llm = engine(vision_checkpoint)
    pad = llm.core.image_processor.image_token_id
    wide = llm.generate(prompt, params, use_tqdm=False)[0]
    small = engine(vision_checkpoint, mm_processor_kwargs={"max_pixels": 64 * 64}).generate(
        prompt, params, use_tqdm=False)[0]
    assert small.prompt_token_ids.count(pad) == 4 and wide.prompt_token_ids.count(pad) == 16
    with pytest.raises(ValueError, match=r"unsupported keys \['sampling_rate'\]"):
        engine(vision_checkpoint, mm_processor_kwargs={"sampling_rate": 16000})


def test_images_encoded_in_bounded_calls(vision_checkpoint, monkeypatch):
    """Three images whose patches pass the encoder's per-call bound (lowered to 40 patches here):
    encoded in several calls, one image alone where it is larger than the bound, with the
    tokens of one call."""
    from deltaspec.engine.vision import features
    rng = np.random.default_rng(11)
    images = [random_image(rng, 96, 96), random_image(rng, 32, 64), random_image(rng, 64, 64)]  # 36, 8, 16 patches
    prompt = {"prompt": f"{USER}{IMAGE} {IMAGE} {IMAGE}{TURN_END}", "multi_modal_data": {"image": images}}
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    together = engine(vision_checkpoint).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(features, "ENCODE_PATCHES", 40)
    llm = engine(vision_checkpoint)
    calls = []

    class Counting:  # the encoder, counting the patches of each call
        def __init__(self, encoder):
            self.encoder = encoder

        def __call__(self, patches, grids):
            calls.append(len(patches))
            return self.encoder(patches, grids)

        def parameters(self):
            return self.encoder.parameters()

    monkeypatch.setattr(llm.core.runner.images, "encoder", Counting(llm.core.runner.images.encoder))
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == together
    assert calls == [36, 24]


def test_dummy_load_reads_images_with_a_random_encoder(vision_checkpoint):
    """load_format "dummy" (benchmarks at real sizes without weights): the vision tower is random
    too, so image prompts run; a model given in memory has no tower and refuses them by name."""
    image = random_image(np.random.default_rng(12), 64, 64)
    prompt = {"prompt": f"{USER}{IMAGE}{TURN_END}", "multi_modal_data": {"image": image}}
    dummy = engine(vision_checkpoint, load_format="dummy")
    assert len(dummy.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    from deltaspec.engine.core import EngineCore
    from deltaspec.engine.engine_config import EngineConfig
    given = EngineCore(EngineConfig(model=str(vision_checkpoint), device="cpu", dtype="float32", warm_up=False,
                                    num_draft_tokens=0), model=dummy.model)
    with pytest.raises(ValueError, match="was given, not loaded"):
        given.add_request([1, 2], SamplingParams(max_tokens=1), images=[dummy.core.image_processor.resize(image)])
