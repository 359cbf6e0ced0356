"""Runs the OpenAI server on a TCP port until SIGINT/SIGTERM, then shuts down gracefully.

The port is bound first (a busy port fails at once, before the model loads), then the engine
starts in a process of its own (engine/engine_process.py: the server's per-token work runs on
this process's core, never on the engine's), or, with `single_process`, on this event loop.
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
from dataclasses import dataclass

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

    async def stop(self) -> None:
        """Stop listening, wait for in-flight requests up to the shutdown timeout, cancel the rest."""
        await self.runner.cleanup()


async def start(engine: Engine, config: ServerConfig, listener: socket.socket | None = None) -> RunningServer:
    """Serve `engine` on `listener` (a bound socket: `listen`), or on config.host and config.port."""
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
    site = web.SockSite(runner, listener) if listener is not None else web.TCPSite(runner, config.host, config.port)
    await site.start()
    return RunningServer(server, runner, runner.addresses[0][1])


def listen(config: ServerConfig) -> socket.socket:
    """The server's socket, bound to config.host and config.port; ValueError (one line) when it
    cannot be (a port in use, an address not on this machine)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        return socket.create_server((config.host, config.port), family=family, backlog=1024)
    except OSError as error:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}") from None


async def serve(engine_config: EngineConfig, config: ServerConfig, single_process: bool = False) -> None:
    listener = listen(config)
    try:
        engine = AsyncLLM(config=engine_config) if single_process else await EngineProcess.start(engine_config)
    except BaseException:
        listener.close()
        raise
    freeze_startup_heap()
    gc_pauses.install()
    try:
        await _serve(engine, config, listener, engine_config)
    finally:
        await engine.shutdown()
    logger.info("stopped")


async def _serve(engine: Engine, config: ServerConfig, listener: socket.socket, engine_config: EngineConfig) -> None:
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
    logger.info("serving %s on http://%s:%d/v1 (engine: %s, %s, %d drafts per step)", config.model_name, config.host,
                running.port, engine_config.device, engine_config.dtype, stats["num_draft_tokens"])
    try:
        await stopping.wait()
        logger.info("shutting down: waiting up to %gs for %d in-flight requests (signal again to abort them)",
                    config.shutdown_timeout, len(running.server.in_flight))
        await running.stop()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
