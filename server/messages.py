"""OpenAI chat messages and tools, carried whole to the chat template, and the rendered prompt.

Every field a template can use reaches it: `name`, `tool_calls` (with `function.arguments`
parsed from JSON text into a dict, as HF and vLLM give templates), `tool_call_id`, a turn's
reasoning (as `reasoning_content` and `reasoning`, from either), and content as a string or a
list of text, image and video parts. Parts stay a list for templates that read parts (Qwen3.5's
`render_content`), an image part as `{"type": "image"}` and a video part as `{"type": "video"}`
in its place, which the template writes as its image or video token (`image_parts` and
`video_parts` list them in that order); they are joined for templates that concatenate strings
(plain ChatML), which have no place for either (`inputs.with_images` and `inputs.with_videos`
refuse the request then). What cannot be honoured (an audio or file part, a refusal, a legacy
`function_call`) is a 400 naming it, never dropped. The rendered prompt can leave a final
assistant message open for the model to continue (`continue_final_message`).

Knows nothing about HTTP or the engine beyond the tokenizer's template rendering.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

import msgspec

from .errors import APIError
from .media import MediaPart
from .protocol import ChatMessage, ContentPart, ImageURL, Tool, VideoURL

# Templates that branch on the content's type, or loop over it, take lists of parts.
_READS_CONTENT_PARTS = re.compile(r"content\s+is\s+(not\s+)?string|for\s+\w+\s+in\s+(message\.|message\[.)?content")


class ChatTemplate(Protocol):
    chat_template: str | None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str: ...


def template_messages(messages: list[ChatMessage], template: str) -> list[dict[str, Any]]:
    """The messages as `template` takes them. OpenAI's "developer" role (its successor to
    "system", which OpenAI's own clients send) goes in as "system" to a template that does not
    name it: Qwen's templates know only system, and refuse any other role."""
    content_parts = bool(_READS_CONTENT_PARTS.search(template))
    developer_as_system = "developer" not in template
    rendered = [_template_message(message, index, content_parts) for index, message in enumerate(messages)]
    for message in rendered:
        if developer_as_system and message["role"] == "developer":
            message["role"] = "system"
    return rendered


def image_parts(messages: list[ChatMessage], param: str | None = None) -> list[MediaPart]:
    """The messages' image parts in the order the template renders them (message by message,
    part by part). param: the field errors about an image name (by default its part's own,
    messages[i].content[j]; a route whose messages were translated from items numbered otherwise
    names its own field)."""
    return _media_parts(messages, "image", param)


def video_parts(messages: list[ChatMessage]) -> list[MediaPart]:
    """The messages' video parts (chat's video_url) in the order the template renders them,
    numbered apart from the images (as the template's "Video N" labels)."""
    return _media_parts(messages, "video", None)


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool against OpenAI's shape; returns name -> the JSON schema of its parameters."""
    schemas = {}
    for index, tool in enumerate(tools):
        try:
            function = msgspec.convert(tool, Tool).function
        except msgspec.ValidationError as error:
            raise APIError(400, f"tools[{index}]: {error}", param=f"tools[{index}]", code="invalid_value") from error
        schemas[function.name] = function.parameters or {}
    return schemas


def render_prompt(tokenizer: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                  chat_template_kwargs: dict[str, Any] | None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
    """The prompt the template renders. continue_final_message (vLLM's, which is HF's): the
    final message, an assistant's, is left open for the model to go on writing
    (Tokenizer.apply_chat_template cuts the prompt right after its text)."""
    if continue_final_message and messages[-1].role != "assistant":
        raise APIError(400, f"continue_final_message needs an assistant message last, not a {messages[-1].role} "
                            f"message", param="continue_final_message", code="invalid_value")
    try:
        return tokenizer.apply_chat_template(template_messages(messages, tokenizer.chat_template or ""),
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools,
                                             **(chat_template_kwargs or {}))
    except ValueError as error:  # the template's raise_exception, a template error, or no template
        raise APIError(400, str(error), param="messages") from error
    except TypeError as error:
        if not chat_template_kwargs:
            raise
        # A kwarg that collides with the template's own variables (messages, tools, bos_token, ...).
        raise APIError(400, f"chat_template_kwargs: {error}", param="chat_template_kwargs") from error


def message_text(message: ChatMessage) -> str:
    """A message's content as one string (text parts joined, as string templates get them)."""
    content = message.content
    return content if isinstance(content, str) else "".join(part.text or "" for part in content or [])


def _template_message(message: ChatMessage, index: int, content_parts: bool) -> dict[str, Any]:
    where = f"messages[{index}]"
    for field, is_set in (("refusal", message.refusal is not None), ("function_call", message.function_call is not None),
                          ("audio", message.audio is not None), ("annotations", bool(message.annotations))):
        if is_set:
            raise APIError(400, f"{where}.{field} is not supported", param=f"{where}.{field}",
                           code="unsupported_parameter")
    if message.role == "tool" and message.tool_call_id is None:
        # The template (and the model) match a result to its call by this id.
        raise APIError(400, f"{where}.tool_call_id is required in a tool message", param=f"{where}.tool_call_id",
                       code="missing_required_parameter")
    rendered: dict[str, Any] = {"role": message.role, "content": _content(message.content, where, content_parts)}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls is not None:
        rendered["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]")
                                  for i, call in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if message.reasoning_content is not None and message.reasoning_content != reasoning:
        raise APIError(400, f"{where} sets reasoning and reasoning_content to different texts: give one (the same "
                            f"field under its two names)", param=f"{where}.reasoning", code="invalid_value")
    if reasoning is not None:
        # Templates read either name (Qwen3.5's reasoning_content).
        rendered["reasoning_content"] = rendered["reasoning"] = reasoning
    return rendered


# A media part's type, and what the template is given in its place.
_MEDIA_PARTS = {"image_url": {"type": "image"}, "video_url": {"type": "video"}}


def _content(content, where: str, content_parts: bool) -> str | list[dict[str, str]]:
    if content is None:
        return ""  # templates that concatenate strings cannot take None; the rest render both alike
    if isinstance(content, str):
        return content
    for index, part in enumerate(content):
        is_text = part.type == "text" and part.text is not None
        if not is_text and part.type not in _MEDIA_PARTS:  # (their URLs are read by `_media_parts`)
            raise APIError(400, f"content parts of type {part.type!r} are not supported (text, image_url and video_url "
                                f"are): {where}.content[{index}]", param=f"{where}.content",
                           code="unsupported_parameter")
    if content_parts:
        return [{"type": "text", "text": part.text} if part.type == "text" else dict(_MEDIA_PARTS[part.type])
                for part in content]
    return "".join(part.text for part in content if part.type == "text")


def _media_parts(messages: list[ChatMessage], modality: str, param: str | None) -> list[MediaPart]:
    """The messages' parts of one modality (image_url or video_url), numbered from 1 in order."""
    kind = f"{modality}_url"
    parts = []
    for index, message in enumerate(messages):
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                if part.type == kind:
                    where = f"messages[{index}].content[{part_index}]"
                    parts.append(MediaPart(_media_url(part, kind, where), len(parts) + 1, param or where, modality))
    return parts


def _media_url(part: ContentPart, kind: str, where: str) -> str:
    """An image_url or video_url part's URL: the object's url, or the field itself as a string
    (vLLM takes both)."""
    value = getattr(part, kind)
    if value is None:
        raise APIError(400, f"{where}.{kind} is required in a part of type {kind!r}",
                       param=f"{where}.{kind}", code="missing_required_parameter")
    return value.url if isinstance(value, (ImageURL, VideoURL)) else value


def _tool_call(call, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError as error:
        raise APIError(400, f"{where}.function.arguments is not valid JSON: {error}",
                       param=f"{where}.function.arguments", code="invalid_value") from error
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object",
                       param=f"{where}.function.arguments", code="invalid_value")
    rendered = {"type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        rendered = {"id": call.id, **rendered}
    return rendered
