"""OpenAI-style errors: `APIError` carries an HTTP status and the `{"error": {message, type, param,
code}}` body; helpers turn msgspec decode failures into one that names the offending field, and
refuse by name what a request sets and the server cannot honour.

Knows nothing about aiohttp or the engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec

from .protocol import ErrorBody, ErrorDetail

# msgspec ends a validation message with " - at `$.field[0].sub`" and names a missing field as
# "Object missing required field `name`" (or "contains unknown field `name`").
_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_NAMED_FIELD = re.compile(r"(?:missing required|contains unknown) field `([^`]+)`")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}  # e.g. Retry-After on a 503
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # OpenAI reports every client error as invalid_request_error and its own faults as
        # server_error; `code` says which case it is.
        self.type = "server_error" if status >= 500 else "invalid_request_error"

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))


def decode_error(error: msgspec.DecodeError) -> APIError:
    """A 400 for a body that is not JSON, or JSON of the wrong shape (naming the field)."""
    if not isinstance(error, msgspec.ValidationError):
        return APIError(400, f"request body is not valid JSON: {error}", code="invalid_json")
    message = str(error)
    at = _AT_PATH.search(message)
    path = at.group(1) if at else ""
    named = _NAMED_FIELD.search(message)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    code = "unknown_parameter" if "unknown field" in message else "invalid_value"
    return APIError(400, message, param=path or None, code=code)


def refuse(checks: Iterable[tuple[str, bool, str]]) -> None:
    """(field, is_set, why): a 400 naming the first field set that cannot be honoured, and why."""
    for field, is_set, why in checks:
        if is_set:
            raise APIError(400, f"{field} is not supported: {why}", param=field, code="unsupported_parameter")


def convert(value: dict[str, Any], struct: type, where: str) -> Any:
    """value checked against struct (a part of a body that holds items of several shapes); a
    mismatch is a 400 naming the field under `where`."""
    try:
        return msgspec.convert(value, struct)
    except msgspec.ValidationError as error:
        named = decode_error(error)
        raise APIError(400, f"{where}: {error}", param=f"{where}.{named.param}" if named.param else where,
                       code=named.code) from error
