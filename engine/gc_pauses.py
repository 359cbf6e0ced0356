"""How long Python's garbage collector has paused this process: pauses counted by generation in
histogram buckets (`gc.callbacks`), and a warning logged for each one long enough to stall every
stream.

The engine's loop and the server's are each one Python thread: a collection stops steps, deltas
and sockets alike, and shows as a burst of slow first tokens. `install()` starts timing this
process's collections (once per process); `snapshot()` gives what was counted so far, which the
server exports per process (`deltaspec_gc_pause_seconds`, server/metrics.py).

Knows nothing about the engine or HTTP.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

from .durations import Durations

logger = logging.getLogger("deltaspec")

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # seconds
WARN_SECONDS = 0.05  # a pause this long is logged


class GCPauses:
    def __init__(self) -> None:
        self.pauses = Durations(BUCKETS, labels=("0", "1", "2"))  # by generation
        self._started: float | None = None

    def on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return  # installed during a collection
        seconds, self._started = time.perf_counter() - self._started, None
        self.pauses.observe(str(info["generation"]), seconds)
        if seconds >= WARN_SECONDS:
            logger.warning("a garbage collection (generation %d, %d objects freed) paused this process for %.0f ms",
                           info["generation"], info["collected"], seconds * 1e3)

    def snapshot(self) -> dict:
        """Durations.snapshot, by generation."""
        return self.pauses.snapshot()


_installed: GCPauses | None = None


def install() -> GCPauses:
    """Time this process's collections from now on (a second call returns the same counts)."""
    global _installed
    if _installed is None:
        _installed = GCPauses()
        gc.callbacks.append(_installed.on_collection)
        # Not the collections of the exit (the start-up heap handed back: async_llm.freeze_startup_heap).
        atexit.register(gc.callbacks.remove, _installed.on_collection)
    return _installed


def installed() -> GCPauses | None:
    return _installed
