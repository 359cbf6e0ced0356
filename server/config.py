"""Server settings: one frozen, validated object built once at start-up (the engine has its own,
`EngineConfig`)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from .cors import CorsPolicy
from .media import MediaPolicy


@dataclass(frozen=True)
class ServerConfig:
    model_name: str                     # the id responses, metrics and logs name; requests may name it
    model_aliases: tuple[str, ...] = ()  # more ids requests may name (vLLM's later --served-model-name values)
    host: str = "127.0.0.1"
    port: int = 8000                    # 0: any free port (the log line says which)
    api_key: str | None = None          # when set, /v1 routes need "Authorization: Bearer <key>" (or "x-api-key")
    max_waiting: int = 256              # queued requests at most; past it new ones get 503
    # Larger request bodies get 413. None: 1 MiB, or 64 MiB where the model reads images and
    # videos (a base64 photo or screenshot is megabytes; a larger video comes by URL; vLLM sets
    # no limit).
    max_body_bytes: int | None = None
    shutdown_timeout: float = 30.0      # seconds in-flight requests get to finish on SIGINT/SIGTERM
    idle_timeout: float = 60.0          # seconds a connection may go without a whole request header
    body_timeout: float = 60.0          # seconds a request body may take to arrive (then 408)
    stream_stall_timeout: float = 60.0  # seconds a stream's client may read nothing before its request is aborted
    tool_call_parser: str | None = None  # qwen3_coder, hermes or none; None: from the chat template
    reasoning_parser: str | None = None  # qwen3 or none; None: qwen3 when the chat template thinks
    chat_template: str | None = None    # a Jinja template replacing the checkpoint's (vLLM's --chat-template)
    cors: CorsPolicy = CorsPolicy()     # which other origins' pages may call the API (vLLM's defaults: all)
    # Where images and videos may come from and how many a request may hold (vLLM's
    # --allowed-media-domains, --allowed-local-media-path, --limit-mm-per-prompt;
    # VLLM_IMAGE_FETCH_TIMEOUT and VLLM_VIDEO_FETCH_TIMEOUT read when made).
    media: MediaPolicy = field(default_factory=MediaPolicy)
    # HTTPS when ssl_certfile is set (vLLM's --ssl-* flags, passed to uvicorn there): the certificate
    # chain's PEM file, the key's (None: in the certificate's file), the CAs client certificates
    # are checked against, and whether clients must send one (ssl.VerifyMode's values).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = ssl.CERT_NONE

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"

    def __post_init__(self) -> None:
        problems = []
        names = self.served_model_names
        if not all(names):
            problems.append("served model names must not be empty")
        if len(set(names)) < len(names):
            problems.append(f"served model names must differ, got {', '.join(map(repr, names))}")
        if not 0 <= self.port <= 65535:
            problems.append(f"port must be in 0..65535, got {self.port}")
        if self.api_key == "":
            problems.append("api_key must not be empty (leave it unset for no authentication)")
        if self.max_waiting < 1:
            problems.append("max_waiting must be >= 1")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            problems.append("max_body_bytes must be >= 1024")
        if self.shutdown_timeout < 0:
            problems.append("shutdown_timeout must be >= 0")
        for name in ("idle_timeout", "body_timeout", "stream_stall_timeout"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        if self.ssl_certfile is None and (self.ssl_keyfile, self.ssl_ca_certs) != (None, None):
            problems.append("ssl_keyfile and ssl_ca_certs need ssl_certfile (the certificate to serve HTTPS with)")
        if self.ssl_cert_reqs not in tuple(ssl.VerifyMode):
            problems.append(f"ssl_cert_reqs must be {ssl.CERT_NONE} (none), {ssl.CERT_OPTIONAL} (optional) or "
                            f"{ssl.CERT_REQUIRED} (required), got {self.ssl_cert_reqs}")
        elif self.ssl_cert_reqs != ssl.CERT_NONE and self.ssl_ca_certs is None:
            problems.append("ssl_cert_reqs asks for client certificates: ssl_ca_certs must name the CAs to check "
                            "them against")
        if problems:
            raise ValueError("invalid ServerConfig: " + "; ".join(problems))
