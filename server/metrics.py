"""Prometheus metrics in the text exposition format (0.0.4), written by hand: no runtime dependency.

The server owns counters and latency histograms that move as requests run (`ServerMetrics`,
one `RequestTimer` per generation request); the engine's gauges (slots, KV blocks, queue depths,
speculation acceptance, step times) are read from `AsyncLLM.stats()` at scrape time, so they are
never stale; so are the garbage collector's pauses and the CPU time, the server process's own
and the engine process's (engine/gc_pauses.py).

The series vLLM users watch are exported under vLLM's names too (`vllm:num_requests_waiting`,
`vllm:time_to_first_token_seconds`, ...: `VLLM_SERIES`), labelled with the served model's name as
vLLM labels them, so dashboards and autoscalers written for vLLM (its Grafana board, KEDA or a
router scaling on the queue) read this server unchanged.

Knows nothing about HTTP; knows the engine only through its stats dict.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict

from ..engine import gc_pauses

# Seconds. TTFT includes queueing and prefill; inter-token latency is one decode step shared by
# the tokens it emitted (a verify step emits several).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

# (metric, stats key, help) for engine values exported as gauges.
ENGINE_GAUGES = (
    ("deltaspec_num_requests_running", "num_running", "Requests holding a sequence slot."),
    ("deltaspec_num_requests_waiting", "num_waiting", "Requests queued for a sequence slot."),
    ("deltaspec_free_slots", "num_free_slots", "Sequence slots free."),
    ("deltaspec_slots", "num_slots", "Sequence slots in the state pool."),
    ("deltaspec_free_kv_blocks", "num_free_kv_blocks", "KV cache blocks free."),
    ("deltaspec_kv_blocks", "num_kv_blocks", "KV cache blocks in the pool."),
    ("deltaspec_num_draft_tokens", "num_draft_tokens", "MTP drafts per step at most (0: speculation off)."),
)


# vLLM's single-series metrics this server has (name after "vllm:", kind, help).
VLLM_SERIES = (
    ("num_requests_running", "gauge", "Requests holding a sequence slot."),
    ("num_requests_waiting", "gauge", "Requests queued for a sequence slot."),
    ("kv_cache_usage_perc", "gauge", "Share of the KV cache's blocks in use (1: full)."),
    ("num_preemptions_total", "counter", "Requests preempted for lack of KV blocks."),
    ("prompt_tokens_total", "counter", "Prompt tokens of admitted requests."),
    ("generation_tokens_total", "counter", "Tokens generated."),
    ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache."),
    ("spec_decode_num_drafts_total", "counter", "Verify steps (draft chains checked), one per request per step."),
    ("spec_decode_num_draft_tokens_total", "counter", "Drafts proposed."),
    ("spec_decode_num_accepted_tokens_total", "counter", "Drafts accepted."),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    if labels:
        name += "{" + ",".join(f'{key}="{_escape(str(v))}"' for key, v in labels.items()) + "}"
    return f"{name} {float(value)!r}"


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Counter:
    """A counter family; `inc` with one value per label name."""

    def __init__(self, name: str, help_text: str, label_names: tuple[str, ...] = ()) -> None:
        self.name, self.help_text, self.label_names = name, help_text, label_names
        self.values: dict[tuple[str, ...], float] = defaultdict(float)
        if not label_names:
            self.values[()] = 0.0  # an unlabelled counter is exported from the start

    def inc(self, amount: float = 1, **labels: str) -> None:
        # (An unlabelled counter moves once per streamed delta: no key to build.)
        self.values[tuple(str(labels[name]) for name in self.label_names) if self.label_names else ()] += amount

    def render(self) -> list[str]:
        lines = _header(self.name, "counter", self.help_text)
        for key, value in sorted(self.values.items()):
            lines.append(_sample(self.name, dict(zip(self.label_names, key)), value))
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help_text, self.buckets = name, help_text, buckets
        self.bucket_counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Record `value` `count` times."""
        self.bucket_counts[bisect.bisect_left(self.buckets, value)] += count
        self.count += count
        self.sum += value * count

    def render(self) -> list[str]:
        return _header(self.name, "histogram", self.help_text) + \
            _histogram_series(self.name, {}, self.buckets, self.bucket_counts, self.sum)


def _histogram_series(name: str, labels: dict[str, str], buckets: tuple[float, ...] | list[float],
                      bucket_counts: list[int], total: float) -> list[str]:
    """One labelled series of a histogram: cumulative buckets (bucket_counts' last past every
    bound: +Inf), sum and count."""
    lines, cumulative = [], 0
    for bound, count in zip((*map(repr, buckets), "+Inf"), bucket_counts):
        cumulative += count
        lines.append(_sample(f"{name}_bucket", {**labels, "le": bound}, cumulative))
    lines.append(_sample(f"{name}_sum", labels, total))
    lines.append(_sample(f"{name}_count", labels, cumulative))
    return lines


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.requests = Counter("deltaspec_requests_total", "HTTP requests to the /v1 routes, by route and status.",
                                ("route", "status"))
        self.finished = Counter("deltaspec_requests_finished_total",
                                "Generation requests finished, by finish reason (abort: client gone or shutdown).",
                                ("finish_reason",))
        self.prompt_tokens = Counter("deltaspec_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("deltaspec_generation_tokens_total", "Tokens generated.")
        self.time_to_first_token = Histogram("deltaspec_time_to_first_token_seconds",
                                             "From request arrival to its first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = Histogram("deltaspec_inter_token_latency_seconds",
                                             "Time between generated tokens of one request.", ITL_BUCKETS)
        self.request_latency = Histogram("deltaspec_e2e_request_latency_seconds",
                                         "From request arrival to its last token.", E2E_BUCKETS)

    def timer(self, num_prompt_tokens: int, arrival: float) -> RequestTimer:
        """Time an admitted generation request that arrived at `arrival` (time.monotonic())."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, arrival)

    def render(self, stats: dict) -> str:
        lines: list[str] = []
        for metric in (self.requests, self.finished, self.prompt_tokens, self.generation_tokens,
                       self.time_to_first_token, self.inter_token_latency, self.request_latency):
            lines += metric.render()
        for name, key, help_text in ENGINE_GAUGES:
            lines += _header(name, "gauge", help_text) + [_sample(name, {}, stats[key])]
        lines += _header("deltaspec_preemptions_total", "counter", "Requests preempted for lack of KV blocks.")
        lines.append(_sample("deltaspec_preemptions_total", {}, stats["num_preempted"]))
        lines += _header("deltaspec_compiles_after_warm_up_total", "counter",
                         "Triton kernels compiled while serving (each stalled every running request).")
        lines.append(_sample("deltaspec_compiles_after_warm_up_total", {}, stats["num_compiles_after_warm_up"]))
        lines += self._render_spec(stats["spec"])
        if stats.get("draft_policy") is not None:
            lines += self._render_draft_policy(stats["draft_policy"])
        lines += self._render_prefix_cache(stats["prefix_cache"])
        lines += self._render_timings(stats)
        lines += self._render_vllm(stats)
        return "\n".join(lines) + "\n"

    def _render_vllm(self, stats: dict) -> list[str]:
        """The same values under vLLM's names (module docstring); vLLM numbers draft positions
        from 0."""
        labels = {"model_name": self.model_name}
        spec, cache = stats["spec"], stats["prefix_cache"]
        values = {
            "num_requests_running": stats["num_running"], "num_requests_waiting": stats["num_waiting"],
            "kv_cache_usage_perc": 1 - stats["num_free_kv_blocks"] / max(stats["num_kv_blocks"], 1),
            "num_preemptions_total": stats["num_preempted"],
            "prompt_tokens_total": self.prompt_tokens.values[()],
            "generation_tokens_total": self.generation_tokens.values[()],
            "prefix_cache_queries_total": cache["prompt_tokens"], "prefix_cache_hits_total": cache["reused_tokens"],
            "spec_decode_num_drafts_total": spec["num_verify_steps"],
            "spec_decode_num_draft_tokens_total": sum(spec["proposed_by_position"]),
            "spec_decode_num_accepted_tokens_total": sum(spec["accepted_by_position"]),
        }
        lines = []
        for name, kind, help_text in VLLM_SERIES:
            lines += _header(f"vllm:{name}", kind, help_text) + [_sample(f"vllm:{name}", labels, values[name])]
        lines += _header("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                         "Drafts accepted at this position (from 0).")
        lines += [_sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": str(i)}, v)
                  for i, v in enumerate(spec["accepted_by_position"])]
        lines += _header("vllm:request_success_total", "counter", "Requests finished, by finish reason.")
        lines += [_sample("vllm:request_success_total", {**labels, "finished_reason": reason}, value)
                  for (reason,), value in sorted(self.finished.values.items())]
        for histogram, name in ((self.time_to_first_token, "time_to_first_token_seconds"),
                                (self.inter_token_latency, "inter_token_latency_seconds"),
                                (self.request_latency, "e2e_request_latency_seconds")):
            lines += _header(f"vllm:{name}", "histogram", histogram.help_text)
            lines += _histogram_series(f"vllm:{name}", labels, histogram.buckets, histogram.bucket_counts,
                                       histogram.sum)
        return lines

    @staticmethod
    def _render_timings(stats: dict) -> list[str]:
        """The engine's step times, and the garbage collector's pauses: this process's, and the
        engine process's when it runs in one (its stats carry them); none where nothing times
        them (`gc_pauses.install`)."""
        lines = _render_durations("deltaspec_step_seconds", "Engine steps' wall time, dispatch to commit, by kind "
                                  "(admit: the step has new rows, prefill chunks or cached prompts).", "kind",
                                  [({}, stats["step_seconds"])])
        # CPU seconds of each process (user + system): with the step times, whether a slow run's
        # engine loop was busy (the host is its limit) or waiting.
        lines += _header("deltaspec_process_cpu_seconds_total", "counter", "CPU time (user + system) of the "
                         "server's process and, when the engine runs in its own, the engine's.")
        lines.append(_sample("deltaspec_process_cpu_seconds_total", {"process": "server"}, time.process_time()))
        if "process_cpu_seconds" in stats:
            lines.append(_sample("deltaspec_process_cpu_seconds_total", {"process": "engine"},
                                 stats["process_cpu_seconds"]))
        pauses = [({"process": "server"}, server.snapshot())] if (server := gc_pauses.installed()) is not None else []
        if "gc_pauses" in stats:
            pauses.append(({"process": "engine"}, stats["gc_pauses"]))
        if pauses:
            lines += _render_durations("deltaspec_gc_pause_seconds", "Pauses of Python's garbage collector, by "
                                       "process and generation (the process's streams wait).", "generation", pauses)
        return lines

    @staticmethod
    def _render_prefix_cache(cache: dict) -> list[str]:
        lines = []
        for name, kind, value, help_text in (
                ("deltaspec_prefix_cache_hit_rate", "gauge", cache["hit_rate"],
                 "Share of prompt tokens served from the prefix cache."),
                ("deltaspec_prefix_cache_checkpoints", "gauge", None, "Checkpoints the prefix cache holds."),
                ("deltaspec_prefix_cache_evictions_total", "counter", cache["evictions"],
                 "Checkpoints evicted from the GPU (to the host tier or dropped).")):
            lines += _header(name, kind, help_text)
            if value is None:
                lines += [_sample(name, {"tier": "gpu"}, cache["gpu_checkpoints"]),
                          _sample(name, {"tier": "host"}, cache["host_checkpoints"])]
            else:
                lines.append(_sample(name, {}, value))
        return lines

    @staticmethod
    def _render_draft_policy(policy: dict) -> list[str]:
        """The adaptive draft length's choices and the step costs it decides on (spec/adaptive.py)."""
        lines = _header("deltaspec_spec_steps_total", "counter", "Decode steps the draft policy ran at each "
                        "draft count (0: a plain step), its probes included.")
        lines += [_sample("deltaspec_spec_steps_total", {"drafts": str(k)}, n) for k, n in policy["steps"].items()]
        lines += _header("deltaspec_spec_step_cost_seconds", "gauge", "What the draft policy prices a decode step "
                         "at, by batch bucket and draft count: its observed wall time.")
        lines += [_sample("deltaspec_spec_step_cost_seconds", {"bucket": str(b), "drafts": str(k)}, seconds)
                  for (b, k), seconds in policy["step_seconds"].items()]
        return lines

    @staticmethod
    def _render_spec(spec: dict) -> list[str]:
        """Position p (1-based) is the p-th draft of a verify step."""
        lines = []
        for name, key, kind, help_text in (
            ("deltaspec_spec_acceptance_rate", "acceptance_by_position", "gauge",
             "Share of drafts at this position that the target accepted."),
            ("deltaspec_spec_draft_tokens_total", "proposed_by_position", "counter",
             "Drafts proposed at this position."),
            ("deltaspec_spec_accepted_tokens_total", "accepted_by_position", "counter",
             "Drafts accepted at this position."),
        ):
            lines += _header(name, kind, help_text)
            lines += [_sample(name, {"position": str(i + 1)}, v) for i, v in enumerate(spec[key])]
        lines += _header("deltaspec_spec_mean_accepted_length", "gauge",
                         "Tokens emitted per verify step (accepted drafts + the target's token).")
        lines.append(_sample("deltaspec_spec_mean_accepted_length", {}, spec["mean_accepted_length"]))
        lines += _header("deltaspec_spec_verify_steps_total", "counter", "Verify steps (one per request per step).")
        lines.append(_sample("deltaspec_spec_verify_steps_total", {}, spec["num_verify_steps"]))
        return lines


def _render_durations(name: str, help_text: str, label_name: str, snapshots: list[tuple[dict[str, str], dict]]) \
        -> list[str]:
    """A histogram family from engine.durations.Durations snapshots, each with its own labels;
    a series per snapshot and label (`label_name`)."""
    lines = _header(name, "histogram", help_text)
    for labels, snapshot in snapshots:
        for label, series in snapshot["series"].items():
            lines += _histogram_series(name, {**labels, label_name: label}, snapshot["buckets"],
                                       series["bucket_counts"], series["seconds"])
    return lines


class RequestTimer:
    """Token timings of one generation request, fed one engine delta at a time."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = self._last = arrival
        self._has_tokens = False

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.monotonic()
        self._metrics.generation_tokens.inc(num_tokens)
        if self._has_tokens:
            # One step emitted these tokens: each waited its share of the gap.
            self._metrics.inter_token_latency.observe((now - self._last) / num_tokens, num_tokens)
        else:
            self._metrics.time_to_first_token.observe(now - self._arrival)
            self._has_tokens = True
        self._last = now

    def finish(self, finish_reason: str) -> None:
        self._metrics.request_latency.observe(time.monotonic() - self._arrival)
        self._metrics.finished.inc(finish_reason=finish_reason)
