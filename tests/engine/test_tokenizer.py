"""Tokenizer loading, chat templates, streaming detokenization, and the checkpoint fixtures."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from fixtures import EOS_TOKEN, make_checkpoint, make_tokenizer

from deltaspec.engine.tokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, Tokenizer, TooManyTokensError

TEXTS = [
    "Hello, world! How are you today?",
    "def fibonacci(n: int) -> int:\n    return n",
    "Le café est très bon. 中文字符测试。你好，世界！ Emoji: 🙂 🚀 🎉 👍.",
    "Ünïcödé ñ ß ø — 🎉🎉 mixed 中 text é",
    "🙂",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer(tmp_path_factory.mktemp("tokenizer")))


# Both detokenizers stream the same test tokenizer (byte-level BPE): the table lookup that the
# engine picks for it, and the generic window decode that any other decoder gets.
DETOKENIZERS = {
    "byte_level": lambda tokenizer, prompt: ByteLevelDetokenizer(tokenizer.token_bytes),
    "generic": lambda tokenizer, prompt: IncrementalDetokenizer(tokenizer, prompt),
}


@pytest.fixture(params=list(DETOKENIZERS))
def make_detokenizer(request: pytest.FixtureRequest, tokenizer: Tokenizer):
    return lambda prompt=None: DETOKENIZERS[request.param](tokenizer, prompt)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_encode_past_max_length_raises_with_the_count(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.encode(text, max_length=len(ids)) == ids
    with pytest.raises(TooManyTokensError) as raised:
        tokenizer.encode(text, max_length=len(ids) - 1)
    assert raised.value.num_tokens == len(ids)


def test_multibyte_characters_span_tokens(tokenizer: Tokenizer) -> None:
    # The detokenizer tests below only mean something if single tokens split characters.
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("中文 🙂")]
    assert any("\ufffd" in piece for piece in pieces)


def test_special_tokens_encode_and_skip(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.encode("<|im_start|>")[0] and ids[-1] in tokenizer.eos_token_ids
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("kind", list(DETOKENIZERS))
def test_detokenizers_write_special_tokens_when_asked(tokenizer: Tokenizer, kind: str) -> None:
    """skip_special_tokens=False streams what decode(..., skip_special_tokens=False) writes, a
    token at a time and in random chunks; True leaves them out as decode does."""
    rng = random.Random(5)
    ids = tokenizer.encode("<|im_start|>user\n中文 🙂 hi<|im_end|><|endoftext|>x<|im_start|>")
    for skip in (True, False):
        for _ in range(5):
            detokenizer = tokenizer.detokenizer([], skip_special_tokens=skip)
            if kind == "generic":
                detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
            assert isinstance(detokenizer, ByteLevelDetokenizer if kind == "byte_level" else IncrementalDetokenizer)
            text, start = "", 0
            while start < len(ids):
                size = rng.randint(1, 3)
                text += detokenizer.push(ids[start:start + size])
                start += size
            assert text + detokenizer.flush() == tokenizer.decode(ids, skip_special_tokens=skip)


def _stream(make_detokenizer, ids: list[int], chunks: list[int], prompt: list[int] | None = None
            ) -> tuple[list[str], str]:
    detokenizer = make_detokenizer(prompt)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detokenizer.push(ids[start:start + size]))
        start += size
    assert start == len(ids)
    return deltas, detokenizer.flush()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_valid_text(tokenizer: Tokenizer, make_detokenizer, text: str, seed: int) -> None:
    rng = random.Random(seed)
    ids = tokenizer.encode(text)
    one_by_one = [1] * len(ids)
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(min(rng.randint(0, 4), len(ids) - sum(chunks)))  # 0: empty pushes too
    prompt = tokenizer.encode("<|im_start|>assistant\nSure: ") if seed % 2 else None
    for pushes in (one_by_one, chunks):
        deltas, tail = _stream(make_detokenizer, ids, pushes, prompt)
        assert all("\ufffd" not in delta for delta in deltas)
        assert tail == ""
        assert "".join(deltas) == text == tokenizer.decode(ids)


@pytest.mark.parametrize("seed", range(10))
def test_incremental_detokenizer_arbitrary_ids(tokenizer: Tokenizer, make_detokenizer, seed: int) -> None:
    # Random ids are invalid UTF-8 and special tokens at times, or past the tokenizer's
    # vocabulary (a model's may be larger): the stream must still add up to decode.
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size + 8) for _ in range(60)]
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(min(rng.randint(1, 3), len(ids) - sum(chunks)))
    deltas, tail = _stream(make_detokenizer, ids, chunks)
    assert "".join(deltas) + tail == tokenizer.decode(ids)


def test_flush_returns_incomplete_character(tokenizer: Tokenizer, make_detokenizer) -> None:
    ids = tokenizer.encode("ok 🙂")
    truncated = ids[:-1]  # the emoji's 4 bytes span several tokens; the first also holds " "
    detokenizer = make_detokenizer()
    streamed = "".join(detokenizer.push([i]) for i in truncated)
    tail = detokenizer.flush()
    # The space may come out with "ok" or with the tail; the partial emoji only in the tail.
    assert streamed.rstrip() == "ok" and "\ufffd" not in streamed and tail.endswith("\ufffd")
    assert streamed + tail == tokenizer.decode(truncated)
    assert detokenizer.flush() == ""


def test_byte_level_table_only_for_byte_level_decoders(tokenizer: Tokenizer, tmp_path: Path) -> None:
    assert tokenizer.token_bytes is not None and isinstance(tokenizer.detokenizer(), ByteLevelDetokenizer)
    assert all(tokenizer.token_bytes[i] == b"" for i in tokenizer.encode("<|im_start|><|im_end|>"))  # special
    shipped = Tokenizer.from_dir(Path(__file__).parents[2] / "models" / "default")
    assert isinstance(shipped.detokenizer(), ByteLevelDetokenizer)
    # Another decoder (here the metaspace one of SentencePiece-style tokenizers) gets the generic path.
    spec = json.loads((make_tokenizer(tmp_path) / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    metaspace = Tokenizer.from_dir(tmp_path)
    assert metaspace.token_bytes is None and isinstance(metaspace.detokenizer(), IncrementalDetokenizer)


def test_detokenizer_window_stays_small(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt " * 50))
    for token in tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20):
        detokenizer.push([token])
        assert len(detokenizer._ids) <= 8


def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_chat_template_jinja_file_wins_and_hf_helpers(tmp_path: Path) -> None:
    make_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{{ eos_token }}|{{ messages | tojson }}|{{ extra }}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    tokenizer = Tokenizer.from_dir(tmp_path)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "café"}], extra=7)
    assert rendered == '<|im_end|>|[{"role": "user", "content": "café"}]|7'
    with pytest.raises(ValueError, match="one message only"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}] * 2)


def test_named_chat_templates_take_default(tmp_path: Path) -> None:
    make_tokenizer(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"},
                               {"name": "default", "template": "default"}]
    config["eos_token"] = {"content": EOS_TOKEN, "special": True}
    config_path.write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.apply_chat_template([]) == "default"
    assert tokenizer.eos_token == EOS_TOKEN


def test_missing_chat_template(tmp_path: Path) -> None:
    make_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    tokenizer = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_merge_generation_config_and_tokenizer(tmp_path: Path) -> None:
    make_tokenizer(tmp_path)
    im_end = Tokenizer.from_dir(tmp_path).encode(EOS_TOKEN)[0]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (0, im_end)  # config.json as fallback
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, im_end]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (1, im_end)  # generation_config wins


def test_missing_or_corrupt_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_checkpoint_loads_in_hf(tmp_path: Path, family: str) -> None:
    transformers = pytest.importorskip("transformers")
    directory = make_checkpoint(tmp_path, family, moe_layout="fused" if family == "qwen3_5_moe" else "per_expert")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(name.startswith("mtp.") for name in info["unexpected_keys"])
    tokenizer = Tokenizer.from_dir(directory)
    assert model.config.eos_token_id in tokenizer.eos_token_ids
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode(TEXTS[2])])).logits
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std() < 30  # neither vanishing nor saturated

    config = json.loads((directory / "config.json").read_text())
    assert config["mtp_num_hidden_layers" if family != "qwen3_next" else "num_nextn_predict_layers"] == 1
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["mtp.fc.weight"] == "model-mtp.safetensors"
    assert any(name.startswith("mtp.layers.0.self_attn.") for name in index["weight_map"])


def test_continue_final_message_with_a_template_that_trims_content(tmp_path: Path) -> None:
    """Qwen3.5's template trims message content: the final assistant text is found stripped,
    and the prompt ends right after it (after its last text part, for content parts)."""
    tokenizer = Tokenizer.from_dir(make_tokenizer(tmp_path))
    tokenizer.set_chat_template((Path(__file__).parents[1] / "server" / "qwen3_5_chat_template.jinja").read_text())
    for content in ("  The answer is  ", [{"type": "text", "text": "  The answer is  "}]):
        messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": content}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        assert prompt.endswith("The answer is") and closed.startswith(prompt) and len(closed) > len(prompt)
    with pytest.raises(ValueError, match="chat template"):
        tokenizer.set_chat_template("{% for %}")
