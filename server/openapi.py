"""The OpenAPI 3.1 document of the server's routes (`GET /openapi.json`), generated from the
msgspec Structs of protocol.py, responses_protocol.py and anthropic_protocol.py
(`msgspec.json.schema_components`): the schemas are the ones requests are decoded with, so the
document cannot drift from what the server accepts.

`ROUTES` lists every route with its request and response bodies; the app registers its handlers
by the same paths (a test checks that each registered route is documented). Knows nothing about
aiohttp or the engine.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from .anthropic_protocol import (AnthropicErrorBody, AnthropicMessage, CountTokensRequest, CountTokensResponse,
                                 MessagesRequest)
from .anthropic_protocol import StreamEvent as AnthropicStreamEvent
from .protocol import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion, CompletionRequest,
                       DetokenizeRequest, DetokenizeResponse, ErrorBody, Health, Model, ModelList, TokenizeRequest,
                       TokenizeResponse, VersionInfo)
from .responses_protocol import Response, ResponsesRequest, StreamEvent

_REF = "#/components/schemas/{name}"


class Route(NamedTuple):
    method: str
    path: str  # OpenAPI's template: {model}
    summary: str
    request: type | None = None     # the JSON body's Struct
    response: type | None = None    # the JSON response's Struct (200)
    stream: Any = None              # each SSE event's Struct (or union of them) when the body asks for stream: true
    content_type: str = "application/json"  # of a response without a Struct (e.g. /metrics)
    error: type = ErrorBody         # the 4xx and 5xx bodies' Struct


ROUTES = (
    Route("post", "/v1/completions", "Complete a prompt (or a list of prompts)", CompletionRequest, Completion,
          Completion),
    Route("post", "/v1/chat/completions", "Answer a chat", ChatCompletionRequest, ChatCompletion,
          ChatCompletionChunk),
    Route("post", "/v1/responses", "Create a model response (OpenAI's Responses API)", ResponsesRequest, Response,
          StreamEvent),
    Route("post", "/v1/messages", "Create a message (Anthropic's Messages API)", MessagesRequest, AnthropicMessage,
          AnthropicStreamEvent, error=AnthropicErrorBody),
    Route("post", "/v1/messages/count_tokens", "Count a message's prompt tokens (Anthropic's Messages API)",
          CountTokensRequest, CountTokensResponse, error=AnthropicErrorBody),
    Route("get", "/v1/models", "The served model", response=ModelList),
    Route("get", "/v1/models/{model}", "One model by id", response=Model),
    Route("post", "/tokenize", "Token ids of a prompt or of rendered chat messages", TokenizeRequest,
          TokenizeResponse),
    Route("post", "/detokenize", "Text of token ids", DetokenizeRequest, DetokenizeResponse),
    Route("get", "/health", "Liveness", response=Health),
    Route("get", "/ping", "Liveness (vLLM's alias of /health)", response=Health),
    Route("post", "/ping", "Liveness (vLLM's alias of /health)", response=Health),
    Route("get", "/version", "The server's version", response=VersionInfo),
    Route("get", "/metrics", "Prometheus metrics", content_type="text/plain"),
    Route("get", "/openapi.json", "This document"),
)


def openapi_document(version: str) -> dict:
    structs = [t for route in ROUTES for t in (route.request, route.response, route.stream, route.error)
               if t is not None]
    types = list(dict.fromkeys(structs))
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    by_type = dict(zip(types, schemas))
    paths: dict[str, dict] = {}
    for route in ROUTES:
        operation: dict = {"summary": route.summary, "operationId": _operation_id(route)}
        if route.request is not None:
            operation["requestBody"] = {"required": True,
                                        "content": {"application/json": {"schema": by_type[route.request]}}}
        ok: dict = {"description": "OK"}
        if route.response is not None:
            ok["content"] = {"application/json": {"schema": by_type[route.response]}}
            if route.stream is not None:
                # Server-sent events: `data: <chunk JSON>` each, then `data: [DONE]` (/v1/responses,
                # /v1/messages: `event: <type>` and `data: <event JSON>` each, no [DONE]).
                ok["content"]["text/event-stream"] = {"schema": by_type[route.stream]}
        elif route.content_type != "application/json":
            ok["content"] = {route.content_type: {"schema": {"type": "string"}}}
        else:
            ok["content"] = {"application/json": {"schema": {"type": "object"}}}
        shape = "an Anthropic-style error" if route.error is AnthropicErrorBody else "an OpenAI-style error"
        error = {"description": shape, "content": {"application/json": {"schema": by_type[route.error]}}}
        operation["responses"] = {"200": ok, "4XX": error, "5XX": error}
        if "{model}" in route.path:
            operation["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(route.path, {})[route.method] = operation
    return {"openapi": "3.1.0", "info": {"title": "deltaspec", "version": version},
            "paths": paths, "components": {"schemas": components}}


def _operation_id(route: Route) -> str:
    words = route.path.strip("/").replace("{", "").replace("}", "").replace(".", "_").replace("/", "_")
    return f"{route.method}_{words}"
