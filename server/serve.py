"""Runs the OpenAI server on a TCP port until SIGINT/SIGTERM, then shuts down gracefully.

The port is bound and the TLS certificate loaded first (a busy port or a bad certificate fails at
once, before the model loads), then the engine starts in a process of its own
(engine/engine_process.py: the server's per-token work runs on this process's core, never on the
engine's), or, with `single_process`, on this event loop.
Shutdown order: stop listening; give in-flight requests up to `shutdown_timeout` seconds to
finish (a second signal aborts them at once); cancel the handlers still running, which aborts
their requests; stop the engine. `start` is the in-process half (tests use it inside their own
event loop); `serve` adds the engine, the signals and the waiting.

Knows nothing about routes (`app`) or argument parsing (`cli`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
from dataclasses import dataclass
from typing import NamedTuple

from aiohttp import web

from ..engine import AsyncLLM, EngineConfig
from ..engine import gc_pauses
from ..engine.async_llm import freeze_startup_heap
from ..engine.engine_process import EngineProcess
from .app import Engine, OpenAIServer
from .config import ServerConfig

logger = logging.getLogger("deltaspec.server")


@dataclass
class RunningServer:
    server: OpenAIServer
    runner: web.AppRunner
    port: int  # the bound port (config.port 0 picks a free one)

    @property
    def url(self) -> str:
        config = self.server.config
        return f"{config.scheme}://{config.host}:{self.port}"

    async def stop(self) -> None:
        """Stop listening, wait for in-flight requests up to the shutdown timeout, cancel the rest."""
        await self.runner.cleanup()


class Listener(NamedTuple):
    socket: socket.socket                # bound to config.host and config.port
    ssl_context: ssl.SSLContext | None   # HTTPS when set


async def start(engine: Engine, config: ServerConfig, listener: Listener | None = None) -> RunningServer:
    """Serve `engine` on `listener`, by default `listen(config)`'s."""
    if listener is None:
        listener = listen(config)
    if config.chat_template is not None:
        # The server renders every chat prompt with the engine's tokenizer (in the server's
        # process); the engine itself renders none.
        engine.tokenizer.set_chat_template(config.chat_template)
    server = OpenAIServer(engine, config)
    # handler_cancellation: a client that disconnects gets its handler cancelled, which closes its
    # engine stream and aborts the request even while nothing is being written to it.
    # auto_decompress off: `OpenAIServer` decompresses bodies itself, so a bad or unsupported
    # Content-Encoding gets a JSON error rather than aiohttp's plain-text one.
    # keepalive_timeout: aiohttp closes a connection that has not sent a whole request header
    # this long after it opened or after its last response (idle, or headers trickling in).
    runner = web.AppRunner(server.app, handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=config.shutdown_timeout, auto_decompress=False,
                           keepalive_timeout=config.idle_timeout)
    await runner.setup()
    await web.SockSite(runner, listener.socket, ssl_context=listener.ssl_context).start()
    return RunningServer(server, runner, runner.addresses[0][1])


def listen(config: ServerConfig) -> Listener:
    """The server's socket, bound to config.host and config.port, and its TLS context; ValueError
    (one line) when they cannot be made (a certificate that does not load, a port in use, an address
    not on this machine)."""
    ssl_context = tls_context(config)  # first: a bad certificate leaves no socket to close
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        return Listener(socket.create_server((config.host, config.port), family=family, backlog=1024), ssl_context)
    except OSError as error:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}") from None


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server side of HTTPS as uvicorn builds it from vLLM's --ssl-* flags; None: plain HTTP."""
    if config.ssl_certfile is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except OSError as error:  # a missing file; ssl.SSLError: not PEM, no key, a key that does not match
        raise ValueError(f"cannot load the TLS certificate {config.ssl_certfile} with its private key "
                         f"({config.ssl_keyfile or 'expected in the same file'}): {error.strerror or error}") from None
    if config.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(config.ssl_ca_certs)
        except OSError as error:
            raise ValueError(f"cannot load the CA certificates {config.ssl_ca_certs}: "
                             f"{error.strerror or error}") from None
    context.verify_mode = ssl.VerifyMode(config.ssl_cert_reqs)
    return context


async def serve(engine_config: EngineConfig, config: ServerConfig, single_process: bool = False) -> None:
    listener = listen(config)
    try:
        engine = AsyncLLM(config=engine_config) if single_process else await EngineProcess.start(engine_config)
    except BaseException:
        listener.socket.close()
        raise
    freeze_startup_heap()
    gc_pauses.install()
    try:
        await _serve(engine, config, listener, engine_config)
    finally:
        await engine.shutdown()
    logger.info("stopped")


async def _serve(engine: Engine, config: ServerConfig, listener: Listener, engine_config: EngineConfig) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    aborting: set[asyncio.Task] = set()  # strong references until the tasks finish

    def on_signal(signum: int) -> None:
        if stopping.is_set():
            logger.info("%s again: aborting in-flight requests", signal.Signals(signum).name)
            task = loop.create_task(running.server.abort_in_flight())
            aborting.add(task)
            task.add_done_callback(aborting.discard)
        stopping.set()

    running = await start(engine, config, listener)
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    stats = await engine.fetch_stats()
    logger.info("serving %s on %s/v1 (engine: %s, %s, %d drafts per step)", config.model_name, running.url,
                engine_config.device, engine_config.dtype, stats["num_draft_tokens"])
    try:
        await stopping.wait()
        logger.info("shutting down: waiting up to %gs for %d in-flight requests (signal again to abort them)",
                    config.shutdown_timeout, len(running.server.in_flight))
        await running.stop()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
