"""Durations counted in histogram buckets, by label, kept as plain data: what a process times
(engine steps, garbage-collection pauses) and hands over as a snapshot, which crosses the engine
process's wire with the stats (msgpack) and which the server exports (server/metrics.py).

Knows nothing about what is timed.
"""

from __future__ import annotations

import bisect


class Durations:
    def __init__(self, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> None:
        """buckets: upper bounds in seconds, ascending; labels: series shown from the start
        (at zero), others appear when first observed."""
        self.buckets = buckets
        self._counts: dict[str, list[int]] = {}   # per label: a count per bucket, the last past every bound
        self._seconds: dict[str, float] = {}
        for label in labels:
            self._series(label)

    def _series(self, label: str) -> list[int]:
        counts = self._counts.get(label)
        if counts is None:
            counts = self._counts[label] = [0] * (len(self.buckets) + 1)
            self._seconds[label] = 0.0
        return counts

    def observe(self, label: str, seconds: float) -> None:
        self._series(label)[bisect.bisect_left(self.buckets, seconds)] += 1
        self._seconds[label] += seconds

    def snapshot(self) -> dict:
        """{"buckets": [bound, ...], "series": {label: {"bucket_counts": [...], "seconds": s}}}."""
        return {"buckets": list(self.buckets),
                "series": {label: {"bucket_counts": list(counts), "seconds": self._seconds[label]}
                           for label, counts in self._counts.items()}}
