"""Timings a server exports: engine steps by kind, the garbage collector's pauses by process
and generation, and each process's CPU time."""

import gc
import logging
import time

from prometheus_client.parser import text_string_to_metric_families

from deltaspec.engine import EngineConfig, SamplingParams, gc_pauses
from deltaspec.engine.core import EngineCore
from deltaspec.engine.durations import Durations
from deltaspec.server.metrics import ServerMetrics


def _count(snapshot: dict, label: str) -> int:
    return sum(snapshot["series"][label]["bucket_counts"])


def test_durations_count_each_observation_in_its_bucket():
    durations = Durations((0.001, 0.01), labels=("a",))
    for seconds in (0.0005, 0.001, 0.005, 0.5):
        durations.observe("b", seconds)
    snapshot = durations.snapshot()
    assert snapshot["buckets"] == [0.001, 0.01]
    assert snapshot["series"]["a"] == {"bucket_counts": [0, 0, 0], "seconds": 0.0}  # shown before any
    assert snapshot["series"]["b"]["bucket_counts"] == [2, 1, 1]  # le 1 ms (bound included), le 10 ms, past
    assert abs(snapshot["series"]["b"]["seconds"] - 0.5065) < 1e-12


def test_each_collection_is_counted_in_its_generation_and_a_long_one_logged(monkeypatch, caplog):
    # A GCPauses of the test's own, not install()'s: that one would stay for the rest of the run.
    pauses = gc_pauses.GCPauses()
    before = pauses.snapshot()
    monkeypatch.setattr(gc_pauses, "WARN_SECONDS", 0.0)  # every pause is long
    gc.callbacks.append(pauses.on_collection)
    try:
        with caplog.at_level(logging.WARNING, logger="deltaspec"):
            gc.collect()
    finally:
        gc.callbacks.remove(pauses.on_collection)
    after = pauses.snapshot()
    assert _count(after, "2") == _count(before, "2") + 1
    assert after["series"]["2"]["seconds"] > before["series"]["2"]["seconds"]
    assert any("garbage collection (generation 2" in r.getMessage() for r in caplog.records)


def test_steps_are_timed_by_kind(checkpoint):
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), max_num_seqs=4, num_draft_tokens=0))
    core.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    steps = 0
    while core.has_work:
        core.step()
        steps += 1
    times = core.stats()["step_seconds"]
    assert _count(times, "admit") == 1 and _count(times, "decode") == steps - 1 >= 3
    assert times["series"]["admit"]["seconds"] > 0
    core.reset_counters()
    assert _count(core.stats()["step_seconds"], "decode") == 0


def test_the_server_exports_step_times_and_both_processes_pauses(monkeypatch):
    server = gc_pauses.GCPauses()  # as install() would have in a server's process
    server.pauses.observe("2", 0.03)
    monkeypatch.setattr(gc_pauses, "_installed", server)
    steps = Durations((0.001, 0.01), labels=("decode", "admit"))
    steps.observe("admit", 0.005)
    engine = Durations(gc_pauses.BUCKETS, labels=("0", "1", "2"))
    engine.observe("2", 2.5)
    text = "\n".join(ServerMetrics._render_timings({"step_seconds": steps.snapshot(),
                                                     "gc_pauses": engine.snapshot(),
                                                     "process_cpu_seconds": 12.5})) + "\n"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("deltaspec_step_seconds_bucket", (("kind", "admit"), ("le", "0.01")))] == 1
    assert samples[("deltaspec_step_seconds_bucket", (("kind", "admit"), ("le", "0.001")))] == 0
    assert samples[("deltaspec_step_seconds_count", (("kind", "decode"),))] == 0
    name = "deltaspec_gc_pause_seconds"
    engine_2 = (("generation", "2"), ("process", "engine"))
    assert samples[(f"{name}_count", engine_2)] == 1 and samples[(f"{name}_sum", engine_2)] == 2.5
    assert samples[(f"{name}_bucket", (("generation", "2"), ("le", "1.0"), ("process", "engine")))] == 0
    assert samples[(f"{name}_bucket", (("generation", "2"), ("le", "0.05"), ("process", "server")))] == 1
    assert samples[(f"{name}_bucket", (("generation", "2"), ("le", "0.02"), ("process", "server")))] == 0
    cpu = "deltaspec_process_cpu_seconds_total"
    assert samples[(cpu, (("process", "engine"),))] == 12.5
    assert 0 < samples[(cpu, (("process", "server"),))] <= time.process_time()
