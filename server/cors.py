"""Cross-origin requests (CORS): a page of another origin calling the API from a browser.

The rules are vLLM's (its --allowed-origins / --allowed-methods / --allowed-headers /
--allow-credentials, FastAPI's CORSMiddleware): by default every origin, method and header,
without credentials, so browser clients that work against vLLM work here. A preflight (OPTIONS
with Origin and Access-Control-Request-Method) is answered by `preflight` before anything else
runs: browsers send no credentials on it, so it must not meet the API key, and it names no route
method. Every other response to a request with an allowed Origin gets the allow headers as it is
prepared (`on_prepare`), streams and error bodies included.

Knows nothing about the routes.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

# What "*" allows in a preflight's answer (Starlette lists the same).
_ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
_MAX_AGE_SECONDS = "600"


@dataclass(frozen=True)
class CorsPolicy:
    """Each tuple holds the allowed values, or "*" for any."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False  # browsers may send cookies and HTTP auth along

    def __post_init__(self) -> None:
        for name in ("origins", "methods", "headers"):
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) and v for v in values):
                raise ValueError(f"CORS {name} must be a list of non-empty strings, got {values!r}")
            object.__setattr__(self, name, tuple(values))
        object.__setattr__(self, "methods", tuple(m.upper() for m in self.methods))

    def allows_origin(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def origin_headers(self, origin: str) -> dict[str, str]:
        """The headers every response to an allowed origin carries."""
        if "*" in self.origins and not self.credentials:
            return {"Access-Control-Allow-Origin": "*"}
        # The answer depends on the request's Origin: caches must keep them apart.
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers


class Cors:
    def __init__(self, policy: CorsPolicy) -> None:
        self.policy = policy

    @web.middleware
    async def preflight(self, request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if request.method != "OPTIONS" or origin is None or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        policy = self.policy
        method = request.headers["Access-Control-Request-Method"].upper()
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        refused = [what for what, allowed in (
            ("origin", policy.allows_origin(origin)),
            ("method", "*" in policy.methods or method in policy.methods),
            ("headers", "*" in policy.headers or {h.lower() for h in asked} <= {h.lower() for h in policy.headers}),
        ) if not allowed]
        if refused:
            # Without the allow headers the browser refuses the request; the body says why.
            return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}")
        headers = policy.origin_headers(origin) | {
            "Access-Control-Allow-Methods": _ALL_METHODS if "*" in policy.methods else ", ".join(policy.methods),
            "Access-Control-Max-Age": _MAX_AGE_SECONDS,
        }
        if asked:
            headers["Access-Control-Allow-Headers"] = ", ".join(asked) if "*" in policy.headers \
                else ", ".join(policy.headers)
        return web.Response(status=200, text="OK", headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and self.policy.allows_origin(origin):
            response.headers.update(self.policy.origin_headers(origin))
