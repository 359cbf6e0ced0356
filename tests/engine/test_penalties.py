"""Penalties, logit_bias, min_tokens, bad_words and allowed_token_ids (engine/penalties.py) against a reference
written here over the full logits with plain Python; in mixed batches; with speculation at
every acceptance count; and the checkpoint's generation defaults."""

import json
import random
import shutil
from functools import lru_cache

import pytest
import torch

from deltaspec.engine import LLM, EngineConfig, SamplingParams
from types import SimpleNamespace

from deltaspec.engine.core import EngineCore
from deltaspec.engine.penalties import Penalties
from deltaspec.engine.request import bad_word_token_ids
from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.sampling import sample_reference

from harness import Job, assert_all_free, check_scripted_speculation, run_alone, run_staggered
from fixtures import GPU_SHAPE

VOCAB = 512


@pytest.fixture
def path(checkpoint):
    return checkpoint("qwen3_5")


@lru_cache(maxsize=None)
def _llm(path, **options):
    return LLM(path, **options)


def reference_adjust(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                     stop_ids: set[int], bad_words: list[list[int]]) -> torch.Tensor:
    """vLLM's definitions, token by token: bad words, logit bias, min_tokens, then repetition
    (prompt and output), frequency and presence (output)."""
    x = logits.clone().float()
    for word in bad_words:
        prefix = word[:-1]
        if len(word) <= len(output) + 1 and (not prefix or output[len(output) - len(prefix):] == prefix):
            x[word[-1]] = float("-inf")
    for token, bias in params.logit_bias:
        x[token] += bias
    if len(output) < params.min_tokens:
        for token in stop_ids:
            x[token] = float("-inf")
    rep = params.repetition_penalty if params.repetition_penalty is not None else 1.0
    for token in set(prompt) | set(output):
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    for token in set(output):
        x[token] = x[token] - (params.frequency_penalty or 0.0) * output.count(token)
        x[token] = x[token] - (params.presence_penalty or 0.0)
    return x


def random_params(rng: random.Random, greedy: bool, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0 if greedy else 0.9, seed=rng.randrange(2**31), ignore_eos=True,
        repetition_penalty=rng.choice([1.0, rng.uniform(1.1, 2.0), rng.uniform(0.5, 0.9)]),
        presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))})


def check_against_reference(llm: LLM, prompt: list[int], params: SamplingParams, output: list[int],
                            bad_words: list[list[int]] = (), stop_ids: set[int] = frozenset()) -> None:
    """Greedy, teacher-forced along the engine's tokens: each is the argmax of the reference's
    adjusted logits at its position (up to float rounding: the engine's decode logits and
    `score`'s prefill logits agree to ~1e-6)."""
    logits = llm.score(prompt + output[:-1])[len(prompt) - 1:]                     # [len(output), V]
    for step, token in enumerate(output):
        x = reference_adjust(logits[step], prompt, output[:step], params, stop_ids, bad_words)
        assert x[token] >= x.max() - 1e-4, f"step {step}: {token} is not the penalized argmax {int(x.argmax())}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_penalties_and_bias_equal_the_reference(path, seed):
    rng = random.Random(seed)
    llm = _llm(path, num_draft_tokens=0)
    for _ in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        params = random_params(rng, greedy=True, max_tokens=12)
        output = llm.generate(prompt, params)[0].token_ids
        check_against_reference(llm, prompt, params, output)
    # Strong penalties change the output (the check above can fail).
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    strong = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=2.0,
                            repetition_penalty=2.0, logit_bias={plain[1]: -100})
    assert llm.generate(prompt, strong)[0].token_ids != plain


def test_sampled_penalties_equal_the_seeded_reference(path):
    """Seeded sampling of a penalized row draws the race of the sampling kernels' reference
    over the penalized logits, at every position (the seed and the position only)."""
    rng = random.Random(7)
    llm = _llm(path, num_draft_tokens=0)
    for _ in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        params = random_params(rng, greedy=False, max_tokens=10)
        output = llm.generate(prompt, params)[0].token_ids
        logits = llm.score(prompt + output[:-1])[len(prompt) - 1:]
        column = lambda value, dtype: torch.tensor([value], dtype=dtype)  # noqa: E731
        for step, token in enumerate(output):
            x = reference_adjust(logits[step], prompt, output[:step], params, set(), [])
            expected, _ = sample_reference(x[None], column(params.temperature, torch.float32),
                                           column(0, torch.int64), column(1.0, torch.float32),
                                           column(0.0, torch.float32), column(params.seed, torch.int64),
                                           column(len(prompt) + step, torch.int64))
            assert token == int(expected), f"step {step}"


def test_min_tokens_and_bad_words(path):
    llm = _llm(path, num_draft_tokens=0)
    tokenizer = llm.tokenizer
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = tokenizer.encode("hello world, the cat")
    plain = llm.generate(prompt, greedy)[0].token_ids
    # min_tokens: the 3rd plain token declared a stop token is banned until 6 tokens are out.
    stop = plain[2]
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop], min_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    assert stop not in out.token_ids[:6] and out.token_ids[:2] == plain[:2]
    check_against_reference(llm, prompt, params, out.token_ids, stop_ids={stop})
    # bad words: a two-token and a one-token word that plain decoding generates.
    def word_of(length):
        for i in range(1, len(plain) - length + 1):
            text = tokenizer.decode(plain[i:i + length])
            if text.strip() and tokenizer.encode(text.lstrip()) == plain[i:i + length]:
                return text
        pytest.skip(f"no {length}-token word in the plain output")
    two, one = word_of(2), word_of(1)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[two, one])
    out = llm.generate(prompt, params)[0].token_ids
    request_words = [list(w) for word in (two, one) for w in bad_word_token_ids(word, tokenizer)]
    check_against_reference(llm, prompt, params, out, bad_words=request_words)
    for word in request_words:
        for i in range(len(out) - len(word) + 1):
            assert out[i:i + len(word)] != word
    assert out != plain


def test_a_mixed_batch_gives_each_request_its_solo_output(path):
    rng = random.Random(11)
    llm = _llm(path, num_draft_tokens=0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    params = [random_params(rng, greedy=i % 2 == 0) if i < 4 else
              SamplingParams(max_tokens=10, temperature=0.0 if i == 4 else 0.8, seed=i, ignore_eos=True)
              for i in range(6)]
    params[1] = SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True,
                               logit_bias={rng.randrange(VOCAB): 8.0 for _ in range(3)})
    alone = [llm.generate(p, q)[0].token_ids for p, q in zip(prompts, params)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone


@pytest.mark.parametrize("k", [0, 2])
def test_bans_beside_unpenalized_rows_give_each_request_its_solo_output(checkpoint, k):
    """Bad words and min_tokens rows among plain ones and other penalized ones (the bans follow
    the penalty pass on the step's penalized subset, gathered and written back), without
    speculation and verified with 2 MTP drafts: each request's output is its solo output."""
    llm = _llm(checkpoint("qwen3_5", mtp_copy_of_last_layer=True), num_draft_tokens=k, adaptive_draft_length=False)
    rng = random.Random(40 + k)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    plain = llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    # Request 0 bans the tokens its plain output starts with: its first token already differs (a
    # prefill step samples every row's first token, here 4 penalized rows of 6).
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, min_tokens=6, stop_token_ids=plain[:3]),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, bad_words=["ab c", "x"],
                             presence_penalty=1.0),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              random_params(rng, greedy=False, max_tokens=12),
              SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, bad_words=["q", "ab c"])]
    alone = [llm.generate(p, q)[0].token_ids for p, q in zip(prompts, params)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone


@pytest.mark.parametrize("k", [0, 2])
def test_allowed_token_ids(checkpoint, k):
    """allowed_token_ids (vLLM's): greedy output is the argmax of the logits restricted to the
    list (teacher-forced against `score`), sampled output stays in it, EOS outside the list
    never ends a request, and beside unrestricted and penalized rows each request gets its solo
    output; without speculation and verified with 2 MTP drafts."""
    llm = _llm(checkpoint("qwen3_5", mtp_copy_of_last_layer=True), num_draft_tokens=k, adaptive_draft_length=False)
    rng = random.Random(70 + k)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    plain = llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    # No list holds EOS; the greedy row's leaves out the tokens its plain output starts with.
    eos = set(llm.tokenizer.eos_token_ids)
    tokens = [t for t in range(VOCAB) if t not in eos]
    allowed = [sorted(rng.sample([t for t in tokens if t not in plain[:2]], 20)), sorted(rng.sample(tokens, 3)),
               [plain[3]]]
    params = [SamplingParams(max_tokens=12, temperature=0, allowed_token_ids=allowed[0]),
              SamplingParams(max_tokens=12, temperature=0.9, seed=3, allowed_token_ids=allowed[1],
                             presence_penalty=1.5),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, allowed_token_ids=allowed[2], repetition_penalty=1.3),
              random_params(rng, greedy=False, max_tokens=12)]
    alone = [llm.generate(p, q)[0] for p, q in zip(prompts, params)]
    together = llm.generate(prompts, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for i, ids in ((0, allowed[0]), (1, allowed[1]), (3, allowed[2])):
        out = together[i].token_ids
        assert set(out) <= set(ids) and len(out) == 12 and together[i].finish_reason == "length"
    assert together[3].token_ids == [plain[3]] * 12
    logits = llm.score(prompts[0] + together[0].token_ids[:-1])[len(prompts[0]) - 1:]
    for step, token in enumerate(together[0].token_ids):
        x = torch.full_like(logits[step], float("-inf"))
        x[allowed[0]] = logits[step][allowed[0]]
        assert x[token] >= x.max() - 1e-4, f"step {step}: {token} is not the restricted argmax {int(x.argmax())}"


def test_each_slot_samples_with_the_request_running_in_it(path):
    """Sampling parameters, penalty coefficients and logit bias are kept per slot on the device,
    written when a request starts: staggered requests (one arriving with a wider logit_bias than
    any so far while another runs; later ones waiting for a running one's place) each give their
    solo output, and each sampled one draws the reference's race over its own filters."""
    rng = random.Random(31)
    bias = lambda n: {rng.randrange(VOCAB): rng.uniform(-8, 8) for _ in range(n)}  # noqa: E731
    params = [
        SamplingParams(max_tokens=8, temperature=0.9, seed=1, presence_penalty=1.0, logit_bias=bias(1),
                       ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, seed=2, frequency_penalty=1.5, logit_bias=bias(4),
                       ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.2, top_k=20, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, min_p=0.05, seed=4, logit_bias=bias(2), ignore_eos=True),
    ]
    jobs = [Job([rng.randrange(VOCAB) for _ in range(rng.randint(2, 20))], p, arrival, None)
            for p, arrival in zip(params, [0, 2, 3, 3, 5])]
    options = dict(model=path, num_draft_tokens=0, max_num_seqs=2, enable_prefix_cache=False)
    together = run_staggered(EngineCore(EngineConfig(**options)), jobs)
    alone = EngineCore(EngineConfig(**options))
    assert [together[i].output_token_ids for i in range(len(jobs))] == [run_alone(alone, job) for job in jobs]
    for job, request in zip(jobs, together.values()):
        p, output = request.params, request.output_token_ids
        if p.greedy:
            continue
        logits = alone.runner.score([job.prompt + output[:-1]])[0][len(job.prompt) - 1:]
        column = lambda value, dtype: torch.tensor([value], dtype=dtype)  # noqa: E731
        for step, token in enumerate(output):
            x = reference_adjust(logits[step], job.prompt, output[:step], p, set(), [])
            expected, _ = sample_reference(x[None], column(p.temperature, torch.float32), column(p.top_k, torch.int64),
                                           column(p.top_p, torch.float32), column(p.min_p, torch.float32),
                                           column(request.seed, torch.int64),
                                           column(len(job.prompt) + step, torch.int64))
            assert token == int(expected), f"{p}: step {step}"


def test_a_reused_slot_keeps_its_statistics_row_when_new_slots_start_beside_it():
    """The statistics table is full (its 4 rows, least recently used first: slots 1, 2, 3, 4);
    a request starts in slot 1 again beside two in new slots: those evict 2 and 3, never slot 1,
    whose row then holds its new request's coefficients."""
    table = Penalties(4, VOCAB, torch.device("cpu"), REFERENCE_OPS)

    def rows(slots_and_penalties):
        return [SimpleNamespace(slot=slot, sample=True, request=SimpleNamespace(
            params=SamplingParams(presence_penalty=penalty).resolve(), prompt_token_ids=[1, 2], output_token_ids=[3]))
            for slot, penalty in slots_and_penalties]

    table.start(rows([(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]))
    started = rows([(1, 1.5), (5, 0.5), (6, 0.6)])
    table.start(started)
    stats = table._rows(started).tolist()
    assert len(set(stats)) == 3 and set(table._row_of) == {1, 4, 5, 6}
    assert table.coefficients[2, stats].tolist() == pytest.approx([1.5, 0.5, 0.6])


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculation_keeps_penalized_output(checkpoint, k):
    """Greedy and seeded penalized requests: identical output with speculation at every
    acceptance count (ScriptedDrafter) and without."""
    path = checkpoint("qwen3_5")
    rng = random.Random(20 + k)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    params = [random_params(rng, greedy=i < 2, max_tokens=24) for i in range(4)]
    params[0] = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.5,
                               presence_penalty=0.5, repetition_penalty=1.3, min_tokens=5, bad_words=["ab c"])
    check_scripted_speculation(path, prompts, params, k)


def test_sampling_params_validation():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(logit_bias={1: 101}), dict(logit_bias={-1: 1}), dict(logit_bias={"x": 1}),
                dict(min_tokens=-1), dict(min_tokens=20, max_tokens=10), dict(bad_words=[""]),
                dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1, 2]), dict(allowed_token_ids=["x"])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_engine_rejects_bias_outside_the_vocabulary(path):
    llm = _llm(path, num_draft_tokens=0)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([1, 2], SamplingParams(allowed_token_ids=[3, VOCAB]))


def test_generation_config_defaults(path, tmp_path):
    """Unset fields take generation_config.json's values ("auto"), not with "none"; a
    request's own value wins."""
    with_defaults = tmp_path / "defaults"
    shutil.copytree(path, with_defaults)
    config = json.loads((with_defaults / "generation_config.json").read_text()) \
        if (with_defaults / "generation_config.json").exists() else {}
    config.update(temperature=0.0, frequency_penalty=2.0, repetition_penalty=0.2)
    (with_defaults / "generation_config.json").write_text(json.dumps(config))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    explicit = SamplingParams(max_tokens=12, temperature=0, frequency_penalty=2.0, repetition_penalty=0.2,
                              ignore_eos=True)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(with_defaults, num_draft_tokens=0)
    assert llm.core.generation_defaults == dict(temperature=0.0, frequency_penalty=2.0, repetition_penalty=0.2)
    reference = _llm(path, num_draft_tokens=0)
    assert (llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
            == reference.generate(prompt, explicit)[0].token_ids
            != reference.generate(prompt, plain)[0].token_ids)
    assert llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=0.0,
                                               repetition_penalty=1.0))[0].token_ids == \
        reference.generate(prompt, plain)[0].token_ids
    off = LLM(with_defaults, num_draft_tokens=0, generation_config="none")
    assert not off.core.generation_defaults
    seeded = SamplingParams(max_tokens=12, seed=3, ignore_eos=True)
    assert off.generate(prompt, seeded)[0].token_ids == \
        reference.generate(prompt, SamplingParams(max_tokens=12, seed=3, temperature=1.0, ignore_eos=True))[0].token_ids


@pytest.mark.gpu
def test_penalized_rows_through_the_cuda_graphs(checkpoint):
    """On the GPU (float32, CUDA graphs, overlapped steps): a batch mixing penalized, biased,
    allowed-token and plain rows gives the same tokens with speculation (real MTP drafts, graphs
    per (bucket, K)) as without, and the same as each request alone."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True, **GPU_SHAPE)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    params = [random_params(rng, greedy=i % 2 == 0, max_tokens=24) if i < 6 else
              SamplingParams(max_tokens=24, temperature=0.0 if i == 6 else 0.8, seed=i, ignore_eos=True)
              for i in range(8)]
    allowed = sorted(rng.sample(range(VOCAB), 12))
    params[1] = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed)
    params[4] = SamplingParams(max_tokens=24, temperature=0.9, seed=4, ignore_eos=True, allowed_token_ids=allowed)
    options = dict(device="cuda", dtype="float32", max_num_seqs=8)
    outputs = []
    for drafts in (0, 3):
        core = EngineCore(EngineConfig(model=path, num_draft_tokens=drafts, **options))
        requests = [core.add_request(p, q) for p, q in zip(prompts, params)]
        while core.has_work:
            core.step()
        outputs.append([r.output_token_ids for r in requests])
        assert_all_free(core)
    assert outputs[0] == outputs[1]
    alone = EngineCore(EngineConfig(model=path, num_draft_tokens=0, **options))
    for prompt, param, together in zip(prompts, params, outputs[0]):
        request = alone.add_request(prompt, param)
        while alone.has_work:
            alone.step()
        assert request.output_token_ids == together
    assert set(outputs[0][1]) | set(outputs[0][4]) <= set(allowed)


@pytest.mark.parametrize("num_draft_tokens", [0, 2])
def test_a_one_token_last_chunk_starts_the_request(path, num_draft_tokens):
    """A prompt whose last prefill chunk is a single token (129 tokens, 128 a step) still takes
    its first token through the first-token path, which starts the slot's sampling parameters
    and penalty statistics: sampled and penalized output equals the one-chunk run's."""
    rng = random.Random(3)
    prompt = [rng.randrange(512) for _ in range(129)]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, presence_penalty=1.5,
                            repetition_penalty=1.3, logit_bias={7: 3.0}, ignore_eos=True)
    outputs = []
    for budget in (128, 256):
        llm = _llm(path, num_draft_tokens=num_draft_tokens, max_num_batched_tokens=budget)
        outputs.append(llm.generate([prompt], params)[0].token_ids)
    assert outputs[0] == outputs[1]
