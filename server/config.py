"""Server settings: one frozen, validated object built once at start-up (the engine has its own,
`EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from .cors import CorsPolicy


@dataclass(frozen=True)
class ServerConfig:
    model_name: str                     # the one id /v1/models lists and requests may name
    host: str = "127.0.0.1"
    port: int = 8000                    # 0: any free port (the log line says which)
    api_key: str | None = None          # when set, /v1 routes need "Authorization: Bearer <key>" (or "x-api-key")
    max_waiting: int = 256              # queued requests at most; past it new ones get 503
    max_body_bytes: int = 1 << 20       # larger request bodies get 413
    shutdown_timeout: float = 30.0      # seconds in-flight requests get to finish on SIGINT/SIGTERM
    idle_timeout: float = 60.0          # seconds a connection may go without a whole request header
    body_timeout: float = 60.0          # seconds a request body may take to arrive (then 408)
    stream_stall_timeout: float = 60.0  # seconds a stream's client may read nothing before its request is aborted
    tool_call_parser: str | None = None  # qwen3_coder, hermes or none; None: from the chat template
    reasoning_parser: str | None = None  # qwen3 or none; None: qwen3 when the chat template thinks
    chat_template: str | None = None    # a Jinja template replacing the checkpoint's (vLLM's --chat-template)
    cors: CorsPolicy = CorsPolicy()     # which other origins' pages may call the API (vLLM's defaults: all)

    def __post_init__(self) -> None:
        problems = []
        if not self.model_name:
            problems.append("model_name must not be empty")
        if not 0 <= self.port <= 65535:
            problems.append(f"port must be in 0..65535, got {self.port}")
        if self.api_key == "":
            problems.append("api_key must not be empty (leave it unset for no authentication)")
        if self.max_waiting < 1:
            problems.append("max_waiting must be >= 1")
        if self.max_body_bytes < 1024:
            problems.append("max_body_bytes must be >= 1024")
        if self.shutdown_timeout < 0:
            problems.append("shutdown_timeout must be >= 0")
        for name in ("idle_timeout", "body_timeout", "stream_stall_timeout"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        if problems:
            raise ValueError("invalid ServerConfig: " + "; ".join(problems))
