"""The embedded API: generate() results, stop conditions, seeded sampling, input validation."""

import dataclasses
import json
import shutil
from functools import lru_cache

import pytest

from deltaspec.engine import LLM, SamplingParams


@pytest.fixture
def path(checkpoint):
    return checkpoint("qwen3_5")


@pytest.fixture
def llm(path):
    return _llm(path)


@lru_cache(maxsize=None)
def _llm(path):
    return LLM(path)


def test_string_and_token_prompts(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    by_text = llm.generate("def fibonacci(n):", greedy)[0]
    by_ids = llm.generate([llm.tokenizer.encode("def fibonacci(n):")], greedy)[0]
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 12
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids)
    assert by_text.finish_reason == "length"


def test_stop_token_ids_and_eos(llm, path, tmp_path):
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    tokens = llm.generate("hello", greedy)[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate("hello", SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == tokens[:first + 1] and out.finish_reason == "stop"
    # The same token declared as EOS: generation stops there, unless ignore_eos.
    eos_path = tmp_path / "eos"
    shutil.copytree(path, eos_path)
    (eos_path / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_at}))
    eos_llm = LLM(eos_path)
    out = eos_llm.generate("hello", SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.token_ids == tokens[:first + 1] and out.finish_reason == "stop"
    assert eos_llm.generate("hello", greedy)[0].token_ids == tokens


def test_stop_string_across_token_boundaries(llm):
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate("The quick", greedy)[0]
    text = full.text
    assert len(text) > 12
    # A stop string that starts inside one token and ends inside a later one.
    stop = text[5:12]
    out = llm.generate("The quick", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]


def test_stop_texts_leave_the_output_unless_included(llm):
    """A stop string or a stop token ends the text before it (vLLM's rule: the stop token's id is
    in token_ids, its text is not); include_stop_str_in_output keeps either, and cuts the text
    right after the stop string."""
    greedy = dict(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate("The quick", SamplingParams(**greedy))[0]
    tokenizer, text, ids = llm.tokenizer, full.text, full.token_ids
    stop = text[5:12]
    start = text.index(stop)
    for include, expected in ((False, text[:start]), (True, text[:start + len(stop)])):
        params = SamplingParams(**greedy, stop=[stop, "\x00never"], include_stop_str_in_output=include)
        out = llm.generate("The quick", params)[0]
        assert out.finish_reason == "stop" and out.text == expected and out.token_ids == ids[:len(out.token_ids)]
    # The 6th token as a stop token (its text is not special: it shows unless it is the stop).
    stop_id = ids[5]
    end = ids.index(stop_id) + 1
    assert tokenizer.decode([stop_id])
    for include, stop_strings in ((False, ()), (True, ()), (False, ("\x00never",)), (True, ("\x00never",))):
        params = SamplingParams(**greedy, stop_token_ids=[stop_id], stop=stop_strings, include_stop_str_in_output=include)
        out = llm.generate("The quick", params)[0]
        assert out.token_ids == ids[:end] and out.finish_reason == "stop"
        assert out.text == tokenizer.decode(ids[:end] if include else ids[:end - 1])


def test_skip_special_tokens_false_writes_them(llm):
    """Special tokens a request generates show in its text with skip_special_tokens=False, as
    the tokenizer's decode writes them, and EOS (a stop token) stays out of it. Forced with
    logit_bias: the tiny model would rarely pick them."""
    tokenizer = llm.tokenizer
    start, end = tokenizer.encode("<|im_start|>")[0], tokenizer.encode("<|im_end|>")[0]
    assert end in tokenizer.eos_token_ids
    for skip in (True, False):
        params = SamplingParams(max_tokens=6, temperature=0, logit_bias={start: 100.0}, skip_special_tokens=skip)
        out = llm.generate("hello", params)[0]
        assert out.token_ids == [start] * 6 and out.text == ("" if skip else "<|im_start|>" * 6)
        params = SamplingParams(max_tokens=6, temperature=0, logit_bias={end: 100.0}, skip_special_tokens=skip)
        out = llm.generate("hello", params)[0]
        assert out.token_ids == [end] and out.text == "" and out.finish_reason == "stop"


def test_chat_renders_each_conversation_and_generates(llm, capsys):
    """LLM.chat (vLLM's): each conversation rendered by the chat template (ChatML here, written
    out by hand), then generated as generate does; continue_final_message leaves the last
    assistant message open; the progress bar counts the requests."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    second = [{"role": "user", "content": "The quick"}, {"role": "assistant", "content": "brown fox "}]
    expected = ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                "<|im_start|>user\nThe quick<|im_end|>\n<|im_start|>assistant\nbrown fox <|im_end|>\n"
                "<|im_start|>assistant\n"]
    outputs = llm.chat([first, second], greedy)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in llm.generate(expected, greedy, use_tqdm=False)]
    assert "generating: 100%" in capsys.readouterr().err and len(llm.chat(first, greedy, use_tqdm=False)) == 1
    assert capsys.readouterr().err == ""
    # The final assistant message continued: the prompt ends with its text, the space kept.
    continued = llm.chat(second, greedy, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    prompt = "<|im_start|>user\nThe quick<|im_end|>\n<|im_start|>assistant\nbrown fox "
    assert continued[0].token_ids == llm.generate(prompt, greedy, use_tqdm=False)[0].token_ids
    with pytest.raises(ValueError, match="cannot both be set"):
        llm.chat(second, greedy, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant message last"):
        llm.chat(first, greedy, add_generation_prompt=False, continue_final_message=True)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate("Hello, world", params)[0].token_ids
    assert llm.generate("Hello, world", params)[0].token_ids == alone
    others = SamplingParams(max_tokens=25, temperature=1.0, seed=7, ignore_eos=True)
    batch = llm.generate(["class Cache:", "Hello, world", "for i in"], [others, params, others])
    assert batch[1].token_ids == alone
    different_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert llm.generate("Hello, world", different_seed)[0].token_ids != alone


def test_negative_seeds_sample_reproducibly(llm):
    """Any int64 seed (clients send -1, as vLLM and OpenAI take it): reproducible, and not the
    stream of its absolute value; n choices count up from it through the int64 wrap."""
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=-1, ignore_eos=True)
    first = llm.generate("Hello, world", params)[0].token_ids
    assert llm.generate("Hello, world", params)[0].token_ids == first
    assert llm.generate("Hello, world", dataclasses.replace(params, seed=1))[0].token_ids != first
    assert [p.seed for p in dataclasses.replace(params, seed=2**63 - 2).for_choices(3)] == [2**63 - 2, 2**63 - 1, -2**63]
    assert [p.seed for p in params.for_choices(2)] == [-1, 0]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_invalid_prompts(llm, path):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 100000]])
    with pytest.raises(ValueError, match="context limit"):
        LLM(path, max_model_len=8).generate([list(range(1, 12))])
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_generation_stops_at_the_context_limit(path):
    out = LLM(path, max_model_len=20).generate([list(range(1, 15))], SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(out[0].token_ids) == 6 and out[0].finish_reason == "length"


def test_a_vllm_offline_script_runs_as_it_is(path):
    """vLLM's LLM(...) keyword arguments, prompt dicts, SamplingParams.n and `outputs`: the choices
    grouped per prompt equal the same choices as separate outputs (generate's n), each prompt
    prefilled once; the engine's seed makes unseeded sampling repeat run after run."""
    options = dict(model=path, enforce_eager=True, trust_remote_code=True, enable_prefix_caching=False,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 2}, kv_cache_dtype="auto",
                   tokenizer=path, max_model_len=256, seed=7)
    llm = LLM(**options)
    config = llm.core.config
    assert (config.enable_cuda_graphs, config.enable_prefix_cache, config.num_draft_tokens, config.seed) == \
        (False, False, 2, 7)
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True)
    ids = llm.tokenizer.encode("x = ")
    grouped = llm.generate([{"prompt": "def f(x):"}, {"prompt_token_ids": ids}], sampling_params=sampled,
                           use_tqdm=False)
    assert [o.prompt for o in grouped] == ["def f(x):", None] and [len(o.outputs) for o in grouped] == [3, 3]
    for output in grouped:
        assert [c.index for c in output.outputs] == [0, 1, 2] and output.finished
        assert (output.text, output.token_ids) == (output.outputs[0].text, output.outputs[0].token_ids)
        assert all(len(c.token_ids) == 8 and c.text == llm.tokenizer.decode(c.token_ids) for c in output.outputs)
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1           # distinct choices
    # Choice i samples with seed + i: with a seed, the grouped choices are generate(n=3)'s, one each.
    seeded = dataclasses.replace(sampled, seed=11)
    [one] = llm.generate("def f(x):", seeded, use_tqdm=False)
    flat = llm.generate("def f(x):", dataclasses.replace(seeded, n=1), n=3, use_tqdm=False)
    assert [c.token_ids for c in one.outputs] == [o.token_ids for o in flat]
    assert [o.outputs[0].index for o in flat] == [0, 1, 2]
    # Unseeded sampling repeats with the engine's seed, and differs with another.
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        engine = LLM(**{**options, "seed": seed})
        return [o.token_ids for o in engine.generate(["a", "b", "c"], unseeded, use_tqdm=False)]

    assert run(7) == run(7) != run(8)
    # Log-probabilities in vLLM's shape: per position {token id: Logprob(logprob, rank, decoded_token)}.
    scored = llm.generate("a", SamplingParams(max_tokens=4, logprobs=2, temperature=0), use_tqdm=False)[0]
    completion = scored.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(sum(e.logprob for e in scored.logprobs))
    for position, token_id, entry in zip(completion.logprobs, completion.token_ids, scored.logprobs):
        assert position[token_id].rank == 1 and position[token_id].logprob == entry.logprob   # greedy
        assert position[token_id].decoded_token == llm.tokenizer.decode_token(token_id)
        assert {t: (lp.logprob, lp.rank) for t, lp in position.items()} == \
            {t: (lp, rank) for rank, (t, lp) in enumerate(entry.top, start=1)}
    # The tokenizer as vLLM scripts reach it; HF's tokenize=True gives the rendered prompt's ids.
    messages = [{"role": "user", "content": "hi"}]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True) == \
        tokenizer.encode(text) and "tokenize" not in text


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype must be one of auto, fp8, fp8_e4m3"),
    (dict(tokenizer="Qwen/Qwen3-0.6B"), "tokenizer 'Qwen/Qwen3-0.6B': the tokenizer is the model's own"),
    (dict(speculative_config={"method": "eagle3", "num_speculative_tokens": 2}), "method 'eagle3' is not supported"),
    (dict(enforce_eager=True, enable_cuda_graphs=True), "enforce_eager means enable_cuda_graphs=False"),
    (dict(seed="7"), "seed must be an int or None"),
])
def test_vllm_options_this_engine_cannot_honour_fail_in_one_line(path, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(path, **options)


def test_prompt_dicts_and_choices_that_cannot_run_are_refused(llm):
    with pytest.raises(ValueError, match="this model reads no images"):
        llm.generate({"prompt": "a", "multi_modal_data": {"image": b"png"}}, use_tqdm=False)
    with pytest.raises(ValueError, match="holds one of 'prompt'"):
        llm.generate({"prompt": "a", "prompt_token_ids": [1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="choices asked for twice"):
        llm.generate("a", SamplingParams(n=2), n=2, use_tqdm=False)
    with pytest.raises(ValueError, match="n = 2: a request is one choice here"):
        llm.core.add_request("a", SamplingParams(n=2))
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["a", "b"], priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="priority 3 needs scheduling_policy 'priority'"):
        llm.generate(["a"], priority=[3], use_tqdm=False)


def test_generate_priority_reaches_each_prompts_params(path):
    """vLLM's generate(..., priority=[...]): each prompt's SamplingParams.priority (the scheduler's
    ordering by it is test_engine.py's test_priority_scheduling)."""
    llm = LLM(path, scheduling_policy="priority", max_num_seqs=1, max_model_len=256)
    seen, add = [], llm.core.add_request

    def add_request(prompt, params, **options):
        seen.append(params.priority)
        return add(prompt, params, **options)

    llm.core.add_request = add_request
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outputs = llm.generate(["a", "b", "c"], greedy, priority=[2, 0, 1], use_tqdm=False)
    assert seen == [2, 0, 1] and [o.prompt for o in outputs] == ["a", "b", "c"]
