"""LLM.beam_search (vLLM's) against a beam search written here over LLM.score's logits: every
step a full forward of each beam with no cache, where the engine's steps are one-token
generates restored from the prefix cache."""

import random

import pytest
import torch

from deltaspec.engine import LLM, BeamSearchParams

VOCAB = 512


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("qwen3_5"), max_model_len=64, num_draft_tokens=0)


def reference_beam_search(llm: LLM, prompt: list[int], width: int, max_tokens: int, eos: frozenset[int],
                          length_penalty: float = 1.0, max_model_len: int = 64) -> list[tuple[list[int], float, str]]:
    """(tokens, cumulative log-probability, finish reason) of the best `width` beams, best first:
    each live beam's 2 * width most likely next tokens (float64 log-softmax of its last logits),
    a candidate ending in EOS or at the context limit complete, the `width` best candidates by
    cum / (length less a final EOS) ** length_penalty live."""
    def score(beam):
        tokens, cum, _ = beam
        return cum / (len(tokens) - (tokens[-1] in eos)) ** length_penalty

    live, done = [(list(prompt), 0.0, "")], []
    for _ in range(max_tokens):
        if not live:
            break
        candidates = []
        for tokens, cum, _ in live:
            logprobs = torch.log_softmax(llm.score(tokens)[-1].double(), dim=-1)
            values, ids = logprobs.topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist()):
                beam = (tokens + [token], cum + value, "")
                if token in eos:
                    done.append((beam[0], beam[1], "stop"))
                elif len(beam[0]) >= max_model_len:
                    done.append((beam[0], beam[1], "length"))
                else:
                    candidates.append(beam)
        live = sorted(candidates, key=score, reverse=True)[:width]
    best = sorted(done + [(tokens, cum, "length") for tokens, cum, _ in live], key=score, reverse=True)
    return best[:width]


def check(llm, outputs, prompts, width, max_tokens, eos, length_penalty=1.0):
    for output, prompt in zip(outputs, prompts):
        expected = reference_beam_search(llm, prompt, width, max_tokens, eos, length_penalty)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _, _ in expected]
        assert [s.finish_reason for s in output.sequences] == [reason for _, _, reason in expected]
        for sequence, (_, cum, _) in zip(output.sequences, expected):
            assert sequence.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert sequence.tokens[:len(prompt)] == prompt
            generated = sequence.tokens[len(prompt):]
            assert len(sequence.logprobs) == len(generated) and all(len(p) >= 2 * width for p in sequence.logprobs)
            assert sequence.cum_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(sequence.logprobs,
                                                                                          generated)), abs=1e-5)
            assert sequence.text == llm.tokenizer.decode(sequence.tokens, False)


def test_beam_search_equals_a_beam_search_over_full_forwards(llm):
    rng = random.Random(11)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (7, 20)]
    before = llm.core.stats()["prefix_cache"]["reused_tokens"]
    outputs = llm.beam_search([{"prompt_token_ids": prompts[0]}, prompts[1]], BeamSearchParams(beam_width=3,
                                                                                                max_tokens=5))
    check(llm, outputs, prompts, 3, 5, frozenset(llm.tokenizer.eos_token_ids))
    # Every step after the first restores each beam's previous prompt from the prefix cache.
    assert llm.core.stats()["prefix_cache"]["reused_tokens"] - before >= 4 * 3 * sum(map(len, prompts))
    text = llm.beam_search(["def fibonacci(n):"], BeamSearchParams(beam_width=2, max_tokens=3))[0]
    check(llm, [text], [llm.tokenizer.encode("def fibonacci(n):")], 2, 3, frozenset(llm.tokenizer.eos_token_ids))


def test_eos_completes_a_beam_and_length_penalty_ranks(llm, monkeypatch):
    """A token the first step ranks second is made the EOS: candidates ending in it leave the
    beam complete ("stop"), and are ranked with the live ones by the length-penalised score."""
    prompt = [3, 14, 15]                        # short: the penalty reorders beams of unlike lengths
    second = torch.log_softmax(llm.score(prompt)[-1].double(), dim=-1).topk(2).indices[1].item()
    monkeypatch.setattr(llm.tokenizer, "eos_token_ids", (second,))
    reasons = {}
    for penalty in (1.0, 0.0, 2.0, 3.0):
        outputs = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=4, length_penalty=penalty))
        check(llm, outputs, [prompt], 4, 4, frozenset({second}), penalty)
        reasons[penalty] = [s.finish_reason for s in outputs[0].sequences]
    assert reasons[1.0][0] == "stop" and reasons[3.0][0] == "length"   # short beams first, then long ones
    ignoring = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True))
    check(llm, ignoring, [prompt], 4, 4, frozenset())


def test_the_context_limit_completes_beams(llm):
    prompt = list(range(1, 61))                                      # 60 of the 64 tokens
    outputs = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert all(len(s.tokens) == 64 and s.finish_reason == "length" for s in outputs[0].sequences)
    check(llm, outputs, [prompt], 2, 10, frozenset())


@pytest.mark.parametrize("options, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an int in \\[1, 10\\]"),
    (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
])
def test_invalid_params_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**options)


def test_media_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        llm.beam_search([{"prompt": "a", "multi_modal_data": {"image": b"png"}}], BeamSearchParams(2, 2))
