"""`GET /openapi.json` and a schema-driven fuzz of every route it documents.

The document must describe every route the app registers, with the request Structs' own
schemas. The fuzz reads the document from a live server on the shipped model and, with a
fixed-seed generator written here, sends each route bodies generated from its request schema —
valid ones, and mutated ones: wrong types, missing required fields, out-of-range numbers, huge
strings and arrays, unicode junk (lone surrogates, NUL, invalid UTF-8), unknown fields, other
content types, truncated JSON, non-object bodies. Every answer must be 2xx or 4xx with an OpenAI
error body, or Anthropic's under /v1/messages (never a 5xx, never a dropped connection, every
stream ending whole: in [DONE], a Responses stream in its response.completed or
response.incomplete event, a Messages stream in message_stop); afterwards the reference greedy
completion is unchanged and the idle gauges are back where they were.
"""

import asyncio
import json
import random
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from deltaspec.engine import AsyncLLM
from deltaspec.server.config import ServerConfig
from deltaspec.server.openapi import ROUTES
from deltaspec.server.serve import start
from fixtures import assert_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "default"
MODEL = "default"
MAX_MODEL_LEN = 512
NUM_CASES = 320  # bodies sent (valid and mutated, over every route with a body)
# Integer fields that set how much work a valid request asks for: kept small so the fuzz stays
# bounded (their out-of-range values are still sent by the mutations).
SMALL_INTS = {"max_tokens": 6, "max_completion_tokens": 6, "max_output_tokens": 6, "min_tokens": 3, "n": 2,
              "best_of": 2, "logprobs": 3, "top_logprobs": 3, "prompt_logprobs": 3}
ANTHROPIC_CLIENT_ERRORS = ("invalid_request_error", "not_found_error", "request_too_large")
JUNK = ["\ud800", "\udfff", "\x00", "\u202e", "\ufeff", "🙂", "\U0010ffff", "é", "中", "\\", "\"", "\n", "{", "]"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    engine = AsyncLLM(DEFAULT_MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, max_body_bytes=1 << 20))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        yield engine, running.server, f"http://127.0.0.1:{running.port}", http
    await running.stop()
    await engine.shutdown()


async def test_the_document_describes_every_route(served):
    _, server, base_url, http = served
    async with http.get(f"{base_url}/openapi.json") as response:
        assert response.status == 200 and response.content_type == "application/json"
        document = await response.json()
    assert document["openapi"].startswith("3.1")
    registered = {(route.method.lower(), route.resource.canonical.replace("{model:.+}", "{model}"))
                  for route in server.app.router.routes() if route.method != "HEAD"}
    documented = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert registered == documented
    schemas = document["components"]["schemas"]
    for route in ROUTES:
        operation = document["paths"][route.path][route.method]
        if route.request is not None:
            ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{route.request.__name__}"
        error = operation["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"]
        assert error == f"#/components/schemas/{route.error.__name__}"  # Anthropic's under /v1/messages
        assert error.endswith("/AnthropicErrorBody") == route.path.startswith("/v1/messages")
    # Generated from the Structs: every field a request Struct declares, with its range.
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    assert {"anyOf": [{"type": "number", "minimum": 0, "maximum": 2}, {"type": "null"}], "default": None} \
        == completion["properties"]["temperature"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1


class Fuzzer:
    """Instances of a JSON schema (the subset msgspec writes: $ref, anyOf, type, enum, const,
    properties/required, items, additionalProperties, min/max, lengths) and their mutations."""

    def __init__(self, schemas: dict, rng: random.Random, hints: dict) -> None:
        """hints: field name -> the value a valid instance takes (what the schema cannot know,
        e.g. the served model's id)."""
        self.schemas, self.rng, self.hints = schemas, rng, hints

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.schemas[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def valid(self, schema: dict, name: str = "", depth: int = 0):
        rng, schema = self.rng, self.resolve(schema)
        if "anyOf" in schema:
            options = [o for o in schema["anyOf"] if o.get("type") != "null"] or schema["anyOf"]
            return self.valid(rng.choice(options), name, depth)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return rng.choice(schema["enum"])
        kind = schema.get("type")
        if kind == "object":
            properties = schema.get("properties", {})
            required = set(schema.get("required", []))
            value = {}
            for key, sub in properties.items():
                # An optional field: mostly absent, sometimes null (how many clients say "unset"),
                # now and then a value.
                chance = rng.random()
                if key in self.hints and (key in required or chance < 0.5):
                    value[key] = self.hints[key]
                elif key in required or (depth < 3 and chance < 0.05 and sub):
                    value[key] = self.valid(sub, key, depth + 1)
                elif chance < 0.3 and (not sub or any(o.get("type") == "null" for o in sub.get("anyOf", ()))):
                    value[key] = None  # (`{}`: any JSON, null included)
            if not properties and depth < 3 and rng.random() < 0.5:
                extra = schema.get("additionalProperties", {})
                value.update({self.text(6): self.valid(extra if isinstance(extra, dict) else {}, "", depth + 1)
                              for _ in range(rng.randint(1, 2))})
            return value
        if kind == "array":
            low = schema.get("minItems", 0)
            return [self.valid(schema.get("items", {}), name, depth + 1) for _ in range(rng.randint(low, low + 2))]
        if kind == "string":
            return self.text(rng.randint(schema.get("minLength", 0), 12))
        if kind == "integer":
            low = schema.get("minimum", -3)
            high = schema.get("maximum", low + SMALL_INTS.get(name, 10))
            return rng.randint(low, min(high, low + SMALL_INTS.get(name, 10)))
        if kind == "number":
            low = schema.get("minimum", schema.get("exclusiveMinimum", -2.0))
            high = schema.get("maximum", low + 4.0)
            return max(rng.uniform(low, high), low + 1e-3) if "exclusiveMinimum" in schema else rng.uniform(low, high)
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "null":
            return None
        return rng.choice([None, 1, "x", [1], {"a": 1}, 2.5, True])  # any JSON

    def text(self, length: int) -> str:
        pieces = "abc xyz def 0123 ()[]:" + "".join(JUNK[4:])
        return "".join(self.rng.choice(pieces) for _ in range(length))

    def numeric_fields(self, schema: dict) -> list[tuple[str, dict]]:
        fields = []
        for key, sub in self.resolve(schema).get("properties", {}).items():
            for option in sub.get("anyOf", [sub]):
                if option.get("type") in ("integer", "number"):
                    fields.append((key, option))
        return fields

    def mutated(self, schema: dict, body: dict) -> tuple[str, bytes, dict]:
        """(what was done, raw body, extra headers)."""
        rng = self.rng
        schema = self.resolve(schema)
        body = dict(body)
        keys = list(schema.get("properties", {}))
        kind = rng.choice(["wrong_type", "missing", "out_of_range", "huge_string", "huge_array", "junk",
                           "unknown_field", "content_type", "truncated", "not_object", "invalid_utf8"])
        headers: dict = {}
        if kind == "wrong_type":
            key = rng.choice(keys)
            body[key] = rng.choice([{"nested": [1, {"x": None}]}, [[[]]], "a string", 12345, -1.5, True, [None]])
        elif kind == "missing" and schema.get("required"):
            body.pop(rng.choice(schema["required"]), None)
        elif kind == "out_of_range" and self.numeric_fields(schema):
            key, option = rng.choice(self.numeric_fields(schema))
            candidates = [10**30, -10**30, 2**63, -(2**63) - 1, 1e308, -1e308]
            if "minimum" in option:
                candidates.append(option["minimum"] - 1)
            if "maximum" in option:
                candidates.append(option["maximum"] + 1)
            body[key] = rng.choice(candidates)
        elif kind == "huge_string":
            key = rng.choice([k for k in keys if k in ("prompt", "model", "user", "stop", "messages")] or keys)
            text = self.text(64) * rng.choice([10, 3000, 20000])  # up to ~1.3 MB: past the body limit too
            body[key] = [{"role": "user", "content": text}] if key == "messages" else text
        elif kind == "huge_array":
            key = rng.choice(keys)
            body[key] = [rng.randint(0, 500) for _ in range(rng.choice([1000, 50000]))]
        elif kind == "junk":
            for key in keys:
                if isinstance(body.get(key), str) or key in ("prompt", "model"):
                    body[key] = "".join(rng.choice(JUNK) for _ in range(rng.randint(1, 40)))
        elif kind == "unknown_field":
            body[rng.choice(["zzz", "logprob", "Max_Tokens", "\u00e9t\u00e9", ""])] = 1
        elif kind == "content_type":
            headers["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded",
                                                  "application/json; charset=latin-1", "multipart/form-data",
                                                  "application/json; charset=utf-8", "image/png"])
        elif kind == "truncated":
            raw = _encode(body)
            return kind, raw[:rng.randint(0, max(len(raw) - 1, 0))], headers
        elif kind == "not_object":
            return kind, rng.choice([b"[]", b"null", b"1", b"\"x\"", b"", b"{", b"[" * 50000, b"\xff\xfe"]), headers
        elif kind == "invalid_utf8":
            raw = _encode(body)
            at = rng.randint(0, len(raw))
            return kind, raw[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]) + raw[at:], headers
        return kind, _encode(body), headers


def _encode(body) -> bytes:
    # ensure_ascii: lone surrogates travel as \ud800 escapes (valid JSON text, not valid UTF-16).
    return json.dumps(body).encode()


def _bounded(path: str, body: dict, rng: random.Random) -> dict:
    """What the schema cannot say: a valid generation request asks for a few tokens at most (an
    unset max_tokens means the rest of the context), and /tokenize takes a prompt or messages.
    Half the generation requests stream."""
    if path == "/tokenize" and body.get("prompt") is None and body.get("messages") is None:
        body["prompt"] = "def fibonacci(n):" if rng.random() < 0.5 else "é中🙂\u202e"
    if path in ("/v1/completions", "/v1/chat/completions"):
        body["max_tokens"] = rng.randint(1, SMALL_INTS["max_tokens"])
        if body.get("stream") is None:
            body["stream"] = rng.random() < 0.5  # both answers, as often
        body.pop("max_completion_tokens", None)
        if body.get("min_tokens") is not None:
            body["min_tokens"] = min(body["min_tokens"], body["max_tokens"])
    if path == "/v1/messages":  # max_tokens is required
        body["max_tokens"] = rng.randint(1, SMALL_INTS["max_tokens"])
        if body.get("stream") is None:
            body["stream"] = rng.random() < 0.5
    if path == "/v1/responses":  # chat's fields and what needs stored responses: refused here
        for name in ("max_tokens", "n", "response_format", "stream_options", "prompt_logprobs", "store",
                     "previous_response_id", "background", "truncation", "top_logprobs"):
            body.pop(name, None)
        body["max_output_tokens"] = rng.randint(1, SMALL_INTS["max_output_tokens"])
        if body.get("stream") is None:
            body["stream"] = rng.random() < 0.5
        if body.get("min_tokens") is not None:
            body["min_tokens"] = min(body["min_tokens"], body["max_output_tokens"])
    return body


async def _check_answer(response: aiohttp.ClientResponse, what: str) -> int:
    """The status, after checking the answer is whole: a JSON error, a JSON body or a stream
    ending in [DONE] without an error event (a Responses stream: typed events, the last the
    whole response, completed or incomplete; a Messages stream: typed events, the last
    message_stop)."""
    assert response.status < 500, f"{what}: {response.status} {await response.text()}"
    raw = await response.read()  # a dropped connection raises here
    if response.status >= 400:
        body = json.loads(raw)
        error = body["error"]
        anthropic = body.get("type") == "error"  # Anthropic's shape: under /v1/messages, and only there
        assert anthropic == response.url.path.startswith("/v1/messages"), what
        if anthropic:
            assert error["message"] and error["type"] in ANTHROPIC_CLIENT_ERRORS, what
        else:
            assert error["message"] and error["type"] == "invalid_request_error", what
        return response.status
    if response.content_type == "text/event-stream" and raw.startswith(b"event: "):
        events = [json.loads(block.partition(b"\ndata: ")[2]) for block in raw.split(b"\n\n") if block.strip()]
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "message_stop"), \
            f"{what}: {events[-1]}"
    elif response.content_type == "text/event-stream":
        events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line.strip()]
        assert events and events[-1] == b"[DONE]", f"{what}: stream did not end with [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), f"{what}: {event!r}"
    elif response.content_type == "application/json":
        json.loads(raw)
    return response.status


async def reference(http: aiohttp.ClientSession, base_url: str) -> str:
    body = {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{base_url}/v1/completions", json=body) as response:
        assert response.status == 200
        return (await response.json())["choices"][0]["text"]


def _gauges(engine: AsyncLLM) -> tuple[int, int]:
    stats = engine.stats()
    return (stats["num_free_slots"] + stats["num_cached_slots"],
            stats["num_free_kv_blocks"] + stats["num_cached_kv_blocks"])


async def _idle(engine: AsyncLLM, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.stats()["num_running"] + engine.stats()["num_waiting"] and \
            asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert_idle(engine.stats())


async def test_schema_fuzz_of_every_route(served):
    engine, _, base_url, http = served
    async with http.get(f"{base_url}/openapi.json") as response:
        document = await response.json()
    expected, gauges = await reference(http, base_url), _gauges(engine)
    async with http.get(f"{base_url}/v1/models") as response:
        [model] = (await response.json())["data"]
    rng = random.Random(20261126)
    fuzzer = Fuzzer(document["components"]["schemas"], rng, {"model": model["id"]})
    with_body = [(path, method, op["requestBody"]["content"]["application/json"]["schema"])
                 for path, operations in document["paths"].items() for method, op in operations.items()
                 if "requestBody" in op]
    without_body = [path for path, operations in document["paths"].items() if "get" in operations]
    assert {path for path, _, _ in with_body} == {"/v1/completions", "/v1/chat/completions", "/v1/responses",
                                                  "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
                                                  "/detokenize"}

    seen: dict[tuple[str, str], set[int]] = {}  # (route, valid or mutation) -> statuses

    async def one(case: int) -> None:
        path, method, schema = with_body[case % len(with_body)]
        body = _bounded(path, fuzzer.valid(schema), rng)
        if case % 3 == 0:
            what, raw, headers = "valid", _encode(body), {}
        else:
            what, raw, headers = fuzzer.mutated(schema, body)  # of a bounded body: the rest stays cheap
        headers = {"Content-Type": "application/json", **headers}
        async with http.request(method, f"{base_url}{path}", data=raw, headers=headers) as response:
            status = await _check_answer(response, f"case {case} {path} {what} {raw[:300]!r}")
        seen.setdefault((path, what), set()).add(status // 100)

    for start in range(0, NUM_CASES, 8):  # 8 at a time: concurrency without a slow queue
        await asyncio.gather(*(one(case) for case in range(start, start + 8)))
    # The fuzz reached both answers of every route, and every kind of mutation.
    for path, _, _ in with_body:
        assert {2, 4} <= set().union(*(statuses for (p, _), statuses in seen.items() if p == path)), path
        assert 2 in seen.get((path, "valid"), set()), f"no valid {path} body was served"
    assert {what for _, what in seen} == {"valid", "wrong_type", "missing", "out_of_range", "huge_string",
                                          "huge_array", "junk", "unknown_field", "content_type", "truncated",
                                          "not_object", "invalid_utf8"}
    for path in without_body:
        for model in ("default", "x" * 5000, "%ff%00", "\u00e9/../../etc", MODEL + "/"):
            url = f"{base_url}{path.replace('{model}', model)}"
            async with http.get(url) as response:
                await _check_answer(response, url[:200])
    await _idle(engine)
    assert await reference(http, base_url) == expected
    await _idle(engine)
    assert _gauges(engine) == gauges
    engine.core.clear_prefix_cache()
    stats = engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_free_slots"] == stats["num_slots"]
