"""The `deltaspec` command line.

    deltaspec serve [MODEL] [--host H] [--port P] ...        OpenAI-compatible server (see serve.py)
    deltaspec generate "prompt" [--model MODEL] ...           stream one completion to stdout
    deltaspec bench acceptance [--model PATH] [--quick] ...   speculation acceptance benchmark
    deltaspec bench serve [--streams 16 64] [--url URL] ...   closed-loop HTTP load vs in-process AsyncLLM

MODEL is a checkpoint directory or a Hugging Face Hub repo id (engine/model_source.py). Both run
on uvloop when it is installed. Knows nothing about models beyond the engine's public API.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import sys
from pathlib import Path

from ..engine import AsyncLLM, EngineConfig, SamplingParams
from ..engine.async_llm import run
from ..engine.model_source import local_config
from . import acceptance_benchmark, serve_benchmark
from .config import ServerConfig
from .cors import CorsPolicy
from .engine_args import accept_vllm_flags, add_engine_options, engine_options
from .media import MediaPolicy
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_CALL_PARSERS
from .serve import serve

# The shipped demonstration model (models/default in a source checkout).
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default"

# vLLM's --uvicorn-log-level values as the server's log level (logging has no trace level).
_LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
               "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG}


def _served_name(model: str) -> str:
    """The model id clients use by default: a directory's name, or the Hub repo id (vLLM's)."""
    path = Path(model).expanduser()
    return path.name if path.is_dir() else model


def _serve(args: argparse.Namespace) -> int:
    model = args.model_path
    # The server's settings first: a bad one fails before a Hub repo is downloaded.
    names = args.served_model_name or [_served_name(model)]
    server_config = ServerConfig(model_name=names[0], model_aliases=tuple(names[1:]), host=args.host, port=args.port,
                                 api_key=args.api_key, max_waiting=args.max_waiting,
                                 max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout,
                                 idle_timeout=args.idle_timeout, body_timeout=args.body_timeout,
                                 stream_stall_timeout=args.stream_stall_timeout,
                                 tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                                 chat_template=_chat_template(args.chat_template),
                                 cors=CorsPolicy(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                                 args.allow_credentials),
                                 ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                                 ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                                 media=MediaPolicy(args.allowed_media_domains, args.allowed_local_media_path,
                                                   **args.limit_mm_per_prompt))
    # A Hub repo is downloaded here, before anything starts: a bad id fails at once.
    engine_config = local_config(EngineConfig(model=model, max_model_len=args.max_model_len,
                                             max_num_seqs=args.max_running,
                                             enable_prefix_cache=not args.no_prefix_cache,
                                             checkpoint_interval=args.checkpoint_interval, seed=args.seed,
                                             host_cache_bytes=int(args.host_cache_gib * 2**30),
                                             **engine_options(args)))
    logging.basicConfig(level=_LOG_LEVELS[args.uvicorn_log_level],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(serve(engine_config, server_config, single_process=args.single_process))
    return 0


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself (vLLM takes both)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: no file {value!r} (pass a Jinja template's path or its text)")


def _string_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings (vLLM's form: '["http://localhost:3000"]') or comma-separated values."""
    try:
        values = json.loads(text)
    except ValueError:
        values = [v.strip() for v in text.split(",")]
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings or comma-separated values, got {text!r}")
    return tuple(values)


# --limit-mm-per-prompt's modalities: images and videos are read and counted; this server reads
# no audio (its parts are refused whatever the limit), so a vLLM command line's limit for it
# changes nothing.
_READ_MODALITIES = ("image", "video")
_UNREAD_MODALITIES = ("audio",)


def _media_limits(text: str) -> dict[str, int | None]:
    """vLLM's --limit-mm-per-prompt as the images and the videos a prompt may hold, MediaPolicy's
    max_images and max_videos (None: no limit): JSON ('{"image": 4, "video": 1}', each a count
    or {"count": N, ...} whose other keys size vLLM's memory profiling, which has no counterpart
    here) or vLLM's older form 'image=4,video=1'."""
    expected = f"expected a JSON object like '{{\"image\": 4, \"video\": 1}}' or image=4,video=1, got {text!r}"
    try:
        limits = json.loads(text)
    except ValueError:
        try:
            limits = {key.strip(): int(value) for key, value in (item.split("=") for item in text.split(","))}
        except ValueError:
            raise argparse.ArgumentTypeError(expected) from None
    if not isinstance(limits, dict):
        raise argparse.ArgumentTypeError(expected)
    unknown = sorted(limits.keys() - {*_READ_MODALITIES, *_UNREAD_MODALITIES})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modalities {unknown}: image and video (and audio, which is not "
                                         f"read) are known")
    counts = {}
    for modality in _READ_MODALITIES:
        limit = limits.get(modality)
        if isinstance(limit, dict):
            limit = limit.get("count")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise argparse.ArgumentTypeError(f"the {modality} limit must be a count >= 0, got {limits[modality]!r}")
        counts[f"max_{modality}s"] = limit
    return counts


def _generate(args: argparse.Namespace) -> int:
    model = args.model
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    engine = AsyncLLM(model, **engine_options(args))

    async def stream() -> None:
        try:
            sys.stdout.write(args.prompt)
            async for delta in engine.generate(args.prompt, params):
                sys.stdout.write(delta.text)
                sys.stdout.flush()  # each delta shows as soon as it is decoded
            sys.stdout.write("\n")
        finally:
            await engine.shutdown()

    run(stream())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaspec")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="serve MODEL over an OpenAI-compatible HTTP API")
    serve_parser.add_argument("model_path", nargs="?", default=str(DEFAULT_MODEL), metavar="MODEL",
                              help="a checkpoint directory or a Hugging Face Hub repo id (default: the shipped "
                                   "model)")
    serve_parser.add_argument("--host", default="127.0.0.1")
    serve_parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    add_engine_options(serve_parser)
    serve_parser.add_argument("--max-model-len", type=int, default=None,
                              help="context length (default: the model's max_position_embeddings)")
    serve_parser.add_argument("--max-running", "--max-num-seqs", dest="max_running", type=int, default=64,
                              help="requests decoding at once")
    serve_parser.add_argument("--max-waiting", type=int, default=256,
                              help="queued requests at most; more get HTTP 503")
    serve_parser.add_argument("--api-key", default=os.environ.get("DELTASPEC_API_KEY"),
                              help="require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on /v1 "
                                   "routes (default: $DELTASPEC_API_KEY)")
    serve_parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                              help="the model ids requests may name; responses, metrics and logs name the first "
                                   "(default: the model directory's name, or the Hub repo id)")
    serve_parser.add_argument("--max-body-bytes", type=int, default=None,
                              help="larger bodies get HTTP 413 (default 1 MiB, 64 MiB for a model that reads images "
                                   "and videos: a larger video is sent by URL)")
    serve_parser.add_argument("--no-prefix-cache", "--no-enable-prefix-caching", dest="no_prefix_cache",
                              action="store_true", help="prefill every prompt in full (prefix reuse is on by default)")
    serve_parser.add_argument("--enable-prefix-caching", dest="no_prefix_cache", action="store_false",
                              help="reuse cached prompt prefixes (the default; vLLM's flag)")
    serve_parser.add_argument("--seed", type=int, default=None,
                              help="the seed requests that set none draw theirs from (vLLM's): the same requests in "
                                   "the same order sample the same tokens (default: fresh entropy)")
    serve_parser.add_argument("--checkpoint-interval", type=int, default=512,
                              help="tokens between the recurrent-state checkpoints a prefill leaves")
    serve_parser.add_argument("--host-cache-gib", type=float, default=0.0,
                              help="pinned host memory evicted prefix checkpoints move to (0: none)")
    serve_parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                              help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    serve_parser.add_argument("--idle-timeout", type=float, default=60.0,
                              help="seconds a connection may go without sending a whole request header, then closed")
    serve_parser.add_argument("--body-timeout", type=float, default=60.0,
                              help="seconds a request body may take to arrive, then HTTP 408")
    serve_parser.add_argument("--stream-stall-timeout", type=float, default=60.0,
                              help="seconds a streaming client may read nothing before its request is aborted and "
                                   "the connection closed")
    serve_parser.add_argument("--single-process", action="store_true",
                              help="run the engine on the server's own event loop instead of a process of its own "
                                   "(the server's per-token work then delays the engine's steps)")
    serve_parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                              help="the tool-call format (default: the one the chat template shows; Qwen3.5's "
                                   "qwen3_coder when it shows none)")
    serve_parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                              help="split reasoning_content at </think> (default: qwen3 when the chat template "
                                   "has <think>)")
    serve_parser.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                              help="the Jinja chat template to render messages with, instead of the checkpoint's")
    serve_parser.add_argument("--uvicorn-log-level", choices=tuple(_LOG_LEVELS), default="info",
                              help="the log level of the server and its engine process (vLLM's flag; trace: debug)")
    tls = serve_parser.add_argument_group("HTTPS (vLLM's flags)")
    tls.add_argument("--ssl-certfile", default=None, metavar="PEM",
                     help="serve HTTPS with this certificate chain (and its private key, unless --ssl-keyfile)")
    tls.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")
    tls.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                     help="the CA certificates clients' certificates are checked against")
    tls.add_argument("--ssl-cert-reqs", type=int, default=ssl.CERT_NONE, metavar="N",
                     help="whether clients must send a certificate: 0 no (default), 1 optional, 2 required "
                          "(Python's ssl.CERT_*)")
    cors = serve_parser.add_argument_group("cross-origin requests from browsers (vLLM's flags and defaults)")
    cors.add_argument("--allowed-origins", type=_string_list, default=("*",), metavar="LIST",
                      help="origins whose pages may call the API: a JSON list or comma-separated (default: any)")
    cors.add_argument("--allowed-methods", type=_string_list, default=("*",), metavar="LIST", help="default: any")
    cors.add_argument("--allowed-headers", type=_string_list, default=("*",), metavar="LIST", help="default: any")
    cors.add_argument("--allow-credentials", action="store_true",
                      help="let browsers send cookies and HTTP authentication along")
    media = serve_parser.add_argument_group("images and videos in requests (vLLM's flags; seconds to fetch one: "
                                            "VLLM_IMAGE_FETCH_TIMEOUT, default 5, and VLLM_VIDEO_FETCH_TIMEOUT, "
                                            "default 30)")
    media.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="the only hosts http(s) image and video URLs may name, redirects included (default: "
                            "any)")
    media.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let file:// image and video URLs read files under DIR (default: file:// URLs are "
                            "refused)")
    media.add_argument("--limit-mm-per-prompt", type=_media_limits, default={}, metavar="JSON",
                       help="images and videos a request may hold at most: '{\"image\": 4, \"video\": 1}' (or "
                            "image=4,video=1; default: as many as the context has room for; an audio limit is "
                            "accepted and changes nothing: audio is not read)")
    # vLLM flags whose behaviour is this server's anyway, so vLLM command lines run unchanged.
    accept_vllm_flags(serve_parser, {
        "--enable-auto-tool-choice": "requests with tools always get their calls parsed (--tool-call-parser none "
                                     "turns that off)",
        "--trust-remote-code": "no checkpoint code is ever run (the engine implements its model families itself)",
        "--disable-log-requests": "requests' prompts and parameters are never logged (aiohttp's access log has one "
                                  "line per request, as uvicorn's in vLLM)",
        "--disable-log-stats": "the server logs no periodic statistics (/metrics has them)"})
    serve_parser.set_defaults(run=_serve)

    generate = commands.add_parser("generate", help="stream a completion of PROMPT to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=str(DEFAULT_MODEL),
                          help="a checkpoint directory or a Hugging Face Hub repo id")
    add_engine_options(generate)
    generate.add_argument("--max-tokens", type=int, default=64)
    # Sampling by default: the small shipped model loops on short prompts when decoding greedily.
    generate.add_argument("--temperature", type=float, default=None,
                          help="0 decodes greedily (default: the checkpoint's, else 1)")
    generate.add_argument("--top-p", type=float, default=None, help="default: the checkpoint's, else 1")
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(run=_generate)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    acceptance_parser = bench.add_parser("acceptance", help="MTP draft acceptance and speedup by draft length")
    acceptance_benchmark.add_arguments(acceptance_parser, DEFAULT_MODEL)
    acceptance_parser.set_defaults(run=lambda args: acceptance_benchmark.main(args, sys.argv[3:] if argv is None else argv[2:]))
    serve_bench_parser = bench.add_parser("serve", help="served vs in-process latency and throughput under "
                                                        "closed-loop streams (and --abuse)")
    serve_benchmark.add_arguments(serve_bench_parser, DEFAULT_MODEL)
    serve_bench_parser.set_defaults(run=lambda args: serve_benchmark.main(args, sys.argv[3:] if argv is None else argv[2:]))

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:  # bad options, config or checkpoint
        print(f"deltaspec: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`deltaspec generate ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
