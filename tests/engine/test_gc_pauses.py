"""The garbage collector's pauses: counted per generation, logged when long, exported by the
server for its own process and the engine's."""

import gc
import logging

from prometheus_client.parser import text_string_to_metric_families

from deltaspec.engine import gc_pauses
from deltaspec.server.metrics import ServerMetrics


def _counts(snapshot: dict, generation: str) -> int:
    return sum(snapshot[generation]["bucket_counts"])


def test_each_collection_is_counted_in_its_generation_and_a_long_one_logged(monkeypatch, caplog):
    pauses = gc_pauses.install()
    assert gc_pauses.install() is pauses and gc_pauses.installed() is pauses
    before = pauses.snapshot()
    monkeypatch.setattr(gc_pauses, "WARN_SECONDS", 0.0)  # every pause is long
    with caplog.at_level(logging.WARNING, logger="deltaspec"):
        gc.collect()
    after = pauses.snapshot()
    assert _counts(after, "2") == _counts(before, "2") + 1
    assert after["2"]["seconds"] > before["2"]["seconds"]
    assert any("garbage collection (generation 2" in r.getMessage() for r in caplog.records)


def test_the_server_exports_its_own_pauses_and_the_engine_process_s():
    gc_pauses.install()
    gc.collect()
    engine = {"0": {"bucket_counts": [3] + [0] * len(gc_pauses.BUCKETS), "seconds": 0.0015},
              "1": {"bucket_counts": [0] * (len(gc_pauses.BUCKETS) + 1), "seconds": 0.0},
              "2": {"bucket_counts": [0] * len(gc_pauses.BUCKETS) + [1], "seconds": 2.5}}
    text = "\n".join(ServerMetrics._render_gc_pauses({"gc_pauses": engine})) + "\n"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    name = "deltaspec_gc_pause_seconds"
    engine_2 = (("generation", "2"), ("process", "engine"))
    assert samples[(f"{name}_count", engine_2)] == 1 and samples[(f"{name}_sum", engine_2)] == 2.5
    assert samples[(f"{name}_bucket", (("generation", "2"), ("le", "1.0"), ("process", "engine")))] == 0
    assert samples[(f"{name}_bucket", (("generation", "0"), ("le", "0.001"), ("process", "engine")))] == 3
    assert samples[(f"{name}_count", (("generation", "2"), ("process", "server")))] >= 1
