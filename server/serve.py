"""Runs the OpenAI server on a TCP port until SIGINT/SIGTERM, then shuts down gracefully.

Shutdown order: stop listening; give in-flight requests up to `shutdown_timeout` seconds to
finish (a second signal aborts them at once); cancel the handlers still running, which aborts
their requests; stop the engine. `start` is the in-process half (tests use it inside their own
event loop); `serve` adds the engine, the signals and the waiting.

Knows nothing about routes (`app`) or argument parsing (`cli`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from dataclasses import dataclass

from aiohttp import web

from ..engine import AsyncLLM, EngineConfig
from .app import OpenAIServer
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


async def start(engine: AsyncLLM, config: ServerConfig) -> RunningServer:
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
    await web.TCPSite(runner, config.host, config.port).start()
    return RunningServer(server, runner, runner.addresses[0][1])


def freeze_startup_heap() -> None:
    """Move every object alive now (the engine, torch, the tokenizer: ~200k of them) out of the
    garbage collector's reach. A full collection walks them all (82 ms for the shipped model's
    process on a 2-core CPU), and a server allocating per token triggers one every few seconds:
    a stall of every stream at once, the tail of time to first token. What is frozen lives for
    the process anyway; objects made later are collected as before."""
    gc.collect()
    gc.freeze()


async def serve(engine_config: EngineConfig, config: ServerConfig) -> None:
    engine = AsyncLLM(config=engine_config)
    freeze_startup_heap()
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

    running = await start(engine, config)
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    logger.info("serving %s on http://%s:%d/v1 (engine: %s, %s, %d drafts per step)", config.model_name, config.host,
                running.port, engine_config.device, engine_config.dtype, engine.stats()["num_draft_tokens"])
    try:
        await stopping.wait()
        logger.info("shutting down: waiting up to %gs for %d in-flight requests (signal again to abort them)",
                    config.shutdown_timeout, len(running.server.in_flight))
        await running.stop()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await engine.shutdown()
    logger.info("stopped")
