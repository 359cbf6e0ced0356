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
import bisect
import gc
import logging
import time

logger = logging.getLogger("deltaspec")

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # seconds
WARN_SECONDS = 0.05  # a pause this long is logged


class GCPauses:
    def __init__(self) -> None:
        # Per generation: counts per bucket (the last past every bound), and the seconds in all.
        self.bucket_counts = [[0] * (len(BUCKETS) + 1) for _ in range(3)]
        self.seconds = [0.0] * 3
        self._started: float | None = None

    def on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return  # installed during a collection
        seconds, self._started = time.perf_counter() - self._started, None
        generation = info["generation"]
        self.bucket_counts[generation][bisect.bisect_left(BUCKETS, seconds)] += 1
        self.seconds[generation] += seconds
        if seconds >= WARN_SECONDS:
            logger.warning("a garbage collection (generation %d, %d objects freed) paused this process for %.0f ms",
                           generation, info["collected"], seconds * 1e3)

    def snapshot(self) -> dict:
        """{generation: {"bucket_counts": [...], "seconds": s}} (generations as strings: it
        crosses the engine process's wire as msgpack)."""
        return {str(g): {"bucket_counts": list(counts), "seconds": seconds}
                for g, (counts, seconds) in enumerate(zip(self.bucket_counts, self.seconds))}


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
