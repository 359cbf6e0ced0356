"""Structured output (engine/structured.py): the tiny random checkpoints write garbage, so the
grammar does all the work — every constrained output must parse and validate, sampled and
greedy, with speculation and without, and the grammar must roll back with rejected drafts
(ScriptedDrafter forces every acceptance count). Constrained rows ride the overlapped pipeline
(their masks computed from the moment the step before's commit has advanced the grammars,
InFlight.prefetch / decide): the output equals the step-by-step engine's, and plain rows beside
them are unchanged. GPU (`gpu` marker): the same
through the CUDA graphs."""

import json
import random
import re

import pytest

from deltaspec.engine import LLM, EngineConfig, SamplingParams, Structured
from deltaspec.engine.core import EngineCore
from deltaspec.engine.request import Request
from deltaspec.engine.runner import InFlight
from deltaspec.engine.scheduler import Scheduler
from deltaspec.engine.structured import Grammars, Matcher
from deltaspec.engine.tokenizer import Tokenizer

from harness import LaunchCounter, assert_all_free, check_scripted_speculation
from fixtures import GPU_SHAPE, make_tokenizer

VOCAB = 512

# Nested objects, arrays, enums, required and optional fields. Strings and arrays are bounded
# and extra properties refused, so a random model's output ends well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", 3, None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"},
                           "codes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "minItems": 1, "maxItems": 2}},
            "required": ["city", "codes"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "status", "address"],
    "additionalProperties": False,
}
MAX_TOKENS = 200


def validate(value, schema) -> None:
    """The subset of JSON Schema SCHEMA uses; raises AssertionError on a violation."""
    if "enum" in schema:
        assert value in schema["enum"] and type(value) in {type(e) for e in schema["enum"]}, value
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(schema.get("required", ())) <= value.keys(), value
        assert schema.get("additionalProperties", True) or value.keys() <= schema["properties"].keys(), value
        for key, item in value.items():
            validate(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9)
        for item in value:
            validate(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1e9), value
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", -1e18) <= value <= schema.get("maximum", 1e18), value
    elif kind == "boolean":
        assert isinstance(value, bool), value
    else:
        raise AssertionError(f"validator lacks {kind}")


def schema_params(rng: random.Random, greedy: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.5]),
                          seed=rng.randrange(2**31), structured=Structured("json_schema", SCHEMA))


def check_outputs(outputs) -> None:
    for output in outputs:
        assert output.finish_reason == "stop", (output.finish_reason, output.text)
        validate(json.loads(output.text), SCHEMA)


@pytest.mark.parametrize("speculative", [False, True])
def test_sampled_json_schema_outputs_validate(checkpoint, speculative):
    """200 sampled requests, run concurrently in one engine, parse and validate, plain and with
    2 drafts a step."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    llm = LLM(path, num_draft_tokens=2 if speculative else 0, adaptive_draft_length=False, max_num_seqs=200)
    rng = random.Random(int(speculative))
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(200)]
    outputs = llm.generate(prompts, [schema_params(rng) for _ in prompts])
    check_outputs(outputs)
    assert all(o.spec_stats is not None for o in outputs) == speculative


def run_mix(path, prompts, params, k: int, async_scheduling: bool, **options) -> tuple[list, int]:
    """Each request's output tokens and the number of steps launched ahead of the one before."""
    core = EngineCore(EngineConfig(model=path, num_draft_tokens=k, adaptive_draft_length=False,
                                   async_scheduling=async_scheduling, **options))
    counter = LaunchCounter(core)
    requests = [core.add_request(p, q) for p, q in zip(prompts, params)]
    while core.has_work:
        core.step()
    assert_all_free(core)
    return [r.output() for r in requests], counter.fed_steps


def mixed_batch(rng: random.Random, max_tokens: int = 40) -> tuple[list, list[SamplingParams]]:
    """Constrained rows (greedy, sampled, one penalized too) beside plain greedy and sampled rows."""
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    params = [schema_params(rng, greedy=i == 0) for i in range(4)]
    params[3] = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, presence_penalty=1.5,
                               structured=Structured("json_schema", SCHEMA))
    params += [SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
               for i in range(4)]
    return prompts, params


@pytest.mark.parametrize("k", [0, 2])
def test_constrained_rows_keep_the_overlapped_pipeline(checkpoint, k):
    """With constrained rows in the batch, steps are still launched ahead of the one before
    them, and every output equals the step-by-step engine's (a mask computed before the step
    before was committed would be another grammar state: other tokens, or an invalid value)."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    prompts, params = mixed_batch(random.Random(20 + k))
    overlapped, fed_steps = run_mix(path, prompts, params, k, async_scheduling=True)
    step_by_step, _ = run_mix(path, prompts, params, k, async_scheduling=False)
    assert fed_steps > 0
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in step_by_step]
    check_outputs(overlapped[:4])


@pytest.mark.parametrize("k", [0, 2])
def test_masks_start_once_the_grammars_took_the_tokens(checkpoint, monkeypatch, k):
    """A commit advances every constrained row's grammar first, then starts the launched step's
    masks (InFlight.prefetch), then records the tokens (Request.extend): the masks are computed
    while the rest of the commit runs, from grammars that hold the step's tokens."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    log = []

    def logged(owner, name, entry):
        function = getattr(owner, name)

        def call(self, *args, **kwargs):
            log.append(entry(self))
            return function(self, *args, **kwargs)
        monkeypatch.setattr(owner, name, call)

    logged(Scheduler, "commit", lambda _: "commit")
    logged(Matcher, "advance", lambda _: "advance")
    logged(InFlight, "prefetch", lambda _: "prefetch")
    logged(Request, "extend", lambda request: "extend" if request.grammar is not None else "extend plain")
    prompts, params = mixed_batch(random.Random(30 + k))
    outputs, fed_steps = run_mix(path, prompts, params, k, async_scheduling=True)
    check_outputs(outputs[:4])
    commits = " ".join(log).split("commit")[1:]
    overlapped = [c.split() for c in commits if "prefetch" in c and "advance" in c]
    assert fed_steps > 0 and overlapped
    for entries in overlapped:
        prefetch = entries.index("prefetch")
        assert entries.count("prefetch") == 1 and "extend" not in entries[:prefetch], entries
        assert "advance" not in entries[prefetch:], entries


def test_json_object_regex_and_choice(checkpoint):
    llm = LLM(checkpoint("qwen3_5"), num_draft_tokens=0)
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(5)] for _ in range(6)]
    kinds = [("json_object", None), ("regex", r"[a-c]{2,4}-\d{3}"), ("choice", ("yes", "no", "maybe"))]
    # json_object may nest without bound on a random model: only its prefix is checked at length.
    for kind, spec in kinds:
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=rng.randrange(2**31),
                                structured=Structured(kind, spec))
        for output in llm.generate(prompts, params):
            if kind == "json_object":
                assert output.text.startswith("{")
                if output.finish_reason == "stop":
                    assert isinstance(json.loads(output.text), dict)
            elif kind == "regex":
                assert output.finish_reason == "stop"
                assert re.fullmatch(spec, output.text), output.text
            else:
                assert output.finish_reason == "stop" and output.text in spec


def test_grammar_in_gbnf_and_lark(checkpoint):
    """A context-free grammar written in llama.cpp's GBNF (vLLM users' EBNF) and the same in
    Lark: sampled outputs of both follow it, and the two dialects give the same greedy output."""
    llm = LLM(checkpoint("qwen3_5"), num_draft_tokens=0)
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(5)] for _ in range(6)]
    gbnf = 'root ::= item ("," item){0,2} "."\nitem ::= "cat" | "dog" | [0-9] [0-9]? | "(" word ")"\nword ::= [a-c]{1,3}'
    lark = 'start: item ("," item)~0..2 "."\nitem: "cat" | "dog" | /[0-9]{1,2}/ | "(" WORD ")"\nWORD: /[a-c]{1,3}/'
    pattern = r"(cat|dog|\d{1,2}|\([a-c]{1,3}\))(,(cat|dog|\d{1,2}|\([a-c]{1,3}\))){0,2}\."
    greedy = {}
    for name, grammar in (("gbnf", gbnf), ("lark", lark)):
        sampled = SamplingParams(max_tokens=60, temperature=1.0, seed=rng.randrange(2**31),
                                 structured=Structured("grammar", grammar))
        for output in llm.generate(prompts, sampled):
            assert output.finish_reason == "stop" and re.fullmatch(pattern, output.text), output.text
        outputs = llm.generate(prompts, SamplingParams(max_tokens=60, temperature=0, structured=("grammar", grammar)))
        greedy[name] = [o.text for o in outputs]
        assert all(re.fullmatch(pattern, text) for text in greedy[name]), greedy[name]
    assert greedy["gbnf"] == greedy["lark"]


def test_any_whitespace_lets_json_have_whitespace(tmp_path):
    """Compact JSON by default: after "{" no whitespace token is allowed; any_whitespace=True
    allows it (vLLM's default, which its users turn off with disable_any_whitespace)."""
    tokenizer = Tokenizer.from_dir(make_tokenizer(tmp_path))
    grammars = Grammars(tokenizer, VOCAB)
    space = tokenizer.encode(" ")
    assert len(space) == 1
    for kind, spec in (("json_object", None), ("json_schema", SCHEMA)):
        for any_whitespace in (False, True):
            matcher = grammars.matcher(Structured(kind, spec, any_whitespace=any_whitespace)).llmatcher
            assert matcher.consume_tokens(tokenizer.encode("{"))
            mask = matcher.compute_bitmask()
            assert bool(mask[space[0] // 8] >> (space[0] % 8) & 1) == any_whitespace


def test_unfinished_output_at_max_tokens_reports_length(checkpoint):
    llm = LLM(checkpoint("qwen3_5"), num_draft_tokens=0)
    output = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0,
                                                      structured=Structured("json_schema", SCHEMA)))[0]
    assert output.finish_reason == "length" and output.text.startswith("{") and len(output.token_ids) == 3


@pytest.mark.parametrize("k", [1, 2, 3])
def test_grammar_rolls_back_with_rejected_drafts(checkpoint, k):
    """Greedy and sampled constrained requests: identical output with speculation at every
    acceptance count (ScriptedDrafter corrupts drafts, often into tokens the grammar refuses)
    and without."""
    path = checkpoint("qwen3_5")
    rng = random.Random(10 + k)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    params = [schema_params(rng, greedy=i < 2) for i in range(4)]
    base = check_scripted_speculation(path, prompts, params, k)
    check_outputs([r.output() for r in base])


def test_matcher_advance_takes_a_steps_tokens_at_once(tmp_path):
    """Matcher.advance over a step's tokens reports the token after which consuming them one by
    one first stops the grammar (it completes, takes EOS, or refuses a token), and leaves the
    matcher where that walk leaves it while the grammar goes on."""
    grammars = Grammars(Tokenizer.from_dir(make_tokenizer(tmp_path)), VOCAB)
    rng = random.Random(8)
    constraints = (Structured("choice", ("yes", "yesno", "no")), Structured("regex", r"[a-c]{1,3}-\d{1,2}"),
                   Structured("json_schema", SCHEMA))
    for structured in constraints:
        for _ in range(15):
            matcher = grammars.matcher(structured)
            walker = grammars.matcher(structured).llmatcher  # draws the tokens
            reference = grammars.matcher(structured).llmatcher
            stopped_at = None
            while stopped_at is None:
                step = []
                for _ in range(rng.randint(1, 4)):
                    mask = walker.compute_bitmask()
                    allowed = [t for t in range(VOCAB) if mask[t // 8] >> (t % 8) & 1]
                    token = rng.choice(allowed) if allowed and rng.random() < 0.9 else rng.randrange(VOCAB)
                    step.append(token)
                    if not walker.consume_token(token) or walker.is_stopped():
                        break
                step += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 1))] if walker.is_stopped() else []
                for taken, token in enumerate(step, start=1):
                    reference.consume_token(token)
                    if reference.is_stopped():
                        stopped_at = taken
                        break
                assert matcher.advance(step) == stopped_at, (structured.kind, step)
                if stopped_at is None:
                    assert matcher.llmatcher.compute_bitmask() == reference.compute_bitmask()


def test_bad_constraints_are_value_errors():
    for kind, spec in (("json_schema", {"type": "objectx"}), ("json_schema", "{not json"), ("json_schema", [1]),
                       ("regex", "[a-"), ("regex", ""), ("choice", ()), ("choice", ("a", "")), ("xml", None),
                       ("json_object", "x"), ("grammar", ""), ("grammar", "root ::= missing"),
                       ("grammar", "start: missing"), ("grammar", "root ::= [a-"), ("grammar", 3)):
        with pytest.raises(ValueError):
            SamplingParams(structured=(kind, spec))
    for bad in ("json_object", ("regex",), {"regex": "a", "choice": ("a",)}):
        with pytest.raises(ValueError):
            SamplingParams(structured=bad)
    with pytest.raises(ValueError):
        Structured("regex", "a+", any_whitespace=True)
    assert SamplingParams(structured={"regex": "a+"}).structured == Structured("regex", "a+")


@pytest.mark.gpu
def test_constrained_rows_through_the_cuda_graphs(checkpoint):
    """On the GPU (float32, CUDA graphs, overlapped steps, the Triton mask kernel): constrained
    outputs parse and validate; each request's tokens are the same with speculation (real MTP
    drafts, graphs per (bucket, K)) as without, and the plain rows' are those they get alone."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True, **GPU_SHAPE)
    prompts, params = mixed_batch(random.Random(7))
    options = dict(device="cuda", dtype="float32", max_num_seqs=8)
    outputs = {}
    for k in (0, 3):
        outputs[k], fed_steps = run_mix(path, prompts, params, k, async_scheduling=True, **options)
        assert fed_steps > 0
        check_outputs(outputs[k][:4])
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[3]]
    for i in range(4, 8):
        alone, _ = run_mix(path, prompts[i:i + 1], params[i:i + 1], 0, async_scheduling=True, **options)
        assert alone[0].token_ids == outputs[0][i].token_ids
