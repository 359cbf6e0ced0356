"""`deltaspec bench serve` and its load generator.

Two CLI runs on the CPU (slow): the shipped model with held-out code prompts, closed loop and the
abuse prompts; a tiny checkpoint with synthetic prompts, closed and open loop from two client
processes, goodput and the server's metrics. The load generator's timing (the closed loop's
window across processes, the open loop's rate) is tested against a fake server that answers
after a fixed delay, so its numbers are exact up to scheduling; goodput and the arrival
processes against hand computations."""

import asyncio
import gc
import json
import multiprocessing
import os
import statistics
import time

import pytest
from aiohttp import web

from deltaspec.server.cli import main
from deltaspec.server.load_generator import (ClientProcesses, Load, PromptSet, Sample, Sampling, Window,
                                             arrival_times, drive, sample)
from deltaspec.server.serve_benchmark import (goodput, host_cpu_times, host_load, metrics_delta,
                                              parse_goodput_target, server_timings)


@pytest.mark.slow
def test_bench_serve_writes_its_report(tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "serve", "--streams", "1", "2", "--requests-per-stream", "2", "--max-tokens", "4",
            "--num-prompts", "4", "--max-prompt-chars", "300", "--max-model-len", "512", "--max-running", "4",
            "--abuse", "--abuse-prompts", "2", "--abuse-bytes", "200000", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "serve-cpu.json").read_text())
    assert report["device"] == "cpu" and report["command"] == "deltaspec bench serve " + " ".join(argv[2:])
    assert report["date"] and report["commit"] and report["max_tokens"] == 4
    assert report["prompt_set"] == {"name": "held-out code", "num_prompts": 4, "unique": False}
    for mode in ("served", "in_process"):
        assert [r["streams"] for r in report[mode]] == [1, 2]
        for r in report[mode]:
            assert r["num_requests"] == 2 * r["streams"] and r["output_tokens"] == 4 * r["num_requests"]
            assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
            for key in ("ttft_s", "itl_s", "e2e_s"):
                assert 0 < r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
            assert len(r["ttft_cdf"]) == r["num_requests"] and isinstance(r["client_bound"], bool)
            assert (r["client_cpu_fraction"] is None) == (mode == "in_process")
    assert all(r["client_processes"] == 1 and len(r["client_cpu_fractions"]) == 1 for r in report["served"])
    assert [r["streams"] for r in report["served_over_in_process"]] == [1, 2]
    assert all(r["output_tokens_per_s"] > 0 for r in report["served_over_in_process"])
    abuse = report["abuse"]
    # Prompts far over the 512-token context: each is refused after tokenizing, never a 5xx.
    assert abuse["abuse_statuses"] == [400, 400]
    assert abuse["itl_p99_without_s"] > 0 and abuse["itl_p99_with_s"] > 0 and abuse["itl_p99_ratio"] > 0
    assert abuse["health_s"]["count"] > 10 and abuse["health_s"]["max"] > 0  # polled through the run
    assert (out / "serve-cpu.png").stat().st_size > 1000


@pytest.mark.slow
def test_bench_serve_synthetic_prompts_open_loop_goodput_and_metrics(checkpoint, tmp_path):
    """Closed loop (3 streams over 2 client processes), then 10 requests at a constant 10/s; each
    prompt 24 random token ids, which the server counts as 24 prompt tokens (usage and
    /metrics). Targets nobody misses: goodput equals throughput."""
    out = tmp_path / "out"
    argv = ["bench", "serve", "--model", str(checkpoint("qwen3_5")), "--streams", "3", "--requests-per-stream", "2",
            "--request-rate", "10", "--num-requests", "10", "--constant-rate", "--input-len", "24",
            "--client-processes", "2", "--goodput", "ttft:600000", "itl:600000", "e2e:600000", "--max-tokens", "3",
            "--max-model-len", "128", "--max-running", "4", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "serve-cpu.json").read_text())
    assert report["prompt_set"] == {"name": "synthetic", "input_len": 24, "input_len_range": 0.0, "unique": True}
    assert report["arrivals"] == "constant"
    for mode in ("served", "in_process"):
        closed, opened = report[mode]
        assert (closed["streams"], closed["request_rate"], closed["num_requests"]) == (3, None, 6)
        assert (opened["streams"], opened["request_rate"], opened["num_requests"]) == (None, 10, 10)
        assert opened["achieved_request_rate"] == pytest.approx(10, rel=0.25)
        for r in (closed, opened):
            assert r["prompt_tokens"] == 24 * r["num_requests"] and r["output_tokens"] == 3 * r["num_requests"]
            assert r["goodput"]["num_requests"] == r["num_requests"] and r["goodput"]["fraction"] == 1
            assert r["goodput"]["requests_per_s"] == r["requests_per_s"]
            assert r["goodput"]["targets_ms"] == {"ttft": 600000, "itl": 600000, "e2e": 600000}
    for r in report["served"]:
        assert r["client_processes"] == 2 and len(r["client_cpu_fractions"]) == 2
        counters, gauges = r["server_metrics"]["counters"], r["server_metrics"]["gauges"]
        assert gauges["deltaspec_num_requests_running"] == 0 and gauges["deltaspec_slots"] > 0
        assert counters['deltaspec_requests_total{route="/v1/completions",status="200"}'] >= r["num_requests"]
    counters = report["served"][1]["server_metrics"]["counters"]  # the open loop: every request counted
    assert counters["deltaspec_prompt_tokens_total"] == 24 * 10
    assert counters["deltaspec_generation_tokens_total"] == 3 * 10
    assert counters['deltaspec_requests_finished_total{finish_reason="length"}'] == 10
    assert [r["request_rate"] for r in report["served_over_in_process"]] == [None, 10]
    assert (out / "serve-cpu.png").stat().st_size > 1000


# The load generator against a fake server -------------------------------------------------------

async def _fake_server(delays: dict[str, float], log: list[tuple[str, float]]):
    """/v1/completions answering `delays[prompt]` seconds later with one token of text and usage
    (prompt tokens: the prompt's length); `log` gets (prompt, arrival time) of each request."""
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        log.append((body["prompt"], time.perf_counter()))
        await asyncio.sleep(delays[body["prompt"]])
        response = web.StreamResponse()
        await response.prepare(request)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1, "total_tokens": 1}
        for chunk in ({"choices": [{"text": "x"}]}, {"choices": [], "usage": usage}):
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_closed_loop_window_opens_when_every_process_has_warmed_up():
    """Stream 0 (process 0) takes 10 ms a request, stream 1 (process 1) 80 ms: stream 0 sends
    several requests while stream 1 warms up; none of them may count, every counted one starts
    once the slow warm-up has ended, and each stream counts exactly its 3."""
    log: list[tuple[str, float]] = []
    runner, url = await _fake_server({"fast": 0.01, "slow": 0.08}, log)
    clients = ClientProcesses(2, url, 10.0, Sampling(4, 0.0), PromptSet("test", ("fast", "slow")))
    try:
        measured = await clients.run(Load("run", 4, num_streams=2, requests_per_stream=3))
    finally:
        clients.close()
        await runner.cleanup()
    assert 0.08 <= measured.window_start < 0.3
    assert len(measured.samples) == 6 and all(s.start >= measured.window_start for s in measured.samples)
    assert sorted(s.prompt_tokens for s in measured.samples) == [4, 4, 4, 4, 4, 4]  # len("fast"), len("slow")
    first = min(t for _, t in log)
    early = [t for prompt, t in log if prompt == "fast" and t - first < measured.window_start]
    assert len(early) >= 4  # stream 0's warm-up and requests during stream 1's: sent, not counted
    assert len(measured.client_cpu_fractions) == 2


async def test_open_loop_sends_at_the_asked_rate_from_several_processes():
    log: list[tuple[str, float]] = []
    runner, url = await _fake_server({"p": 0.05}, log)
    clients = ClientProcesses(2, url, 10.0, Sampling(4, 0.0), PromptSet("test", ("p",)))
    arrivals = arrival_times(50, 20, None, 1.0, True, 0)
    try:
        measured = await clients.run(Load("run", 4, arrivals=arrivals, request_rate=50))
    finally:
        clients.close()
        await runner.cleanup()
    starts = [s.start for s in measured.samples]
    assert len(starts) == 20 and measured.window_start == 0.0
    assert (len(starts) - 1) / (max(starts) - min(starts)) == pytest.approx(50, rel=0.15)
    assert all(abs(start - arrival) < 0.05 for start, arrival in zip(starts, arrivals))


async def test_a_failing_request_fails_the_run_with_its_client_s_traceback():
    runner, url = await _fake_server({}, [])  # every prompt unknown: 500
    clients = ClientProcesses(1, url, 10.0, Sampling(4, 0.0), PromptSet("test", ("p",)))
    try:
        with pytest.raises(RuntimeError, match="the server answered 500"):
            await clients.run(Load("run", 4, num_streams=1, requests_per_stream=1))
    finally:
        clients.close()
        await runner.cleanup()


def test_window_opens_at_the_latest_warm_up_end():
    """The last stream to take the lock may have read the clock before another did."""
    window = Window(multiprocessing.get_context("spawn"))
    window.warmed(3, 1.0)
    window.warmed(3, 1.2)
    assert window.start is None
    window.warmed(3, 1.1)
    assert window.start == 1.2
    window.reset()
    assert window.start is None


def test_closed_loop_warm_ups_spread_the_streams():
    """In one process: the warm-ups ask for 1/2 and 2/2 of the output, the rest for all of it;
    each stream cycles its own prompts."""
    sent: list[tuple[str, int | None]] = []

    async def send(prompt: str, origin: float, max_tokens: int | None = None) -> Sample:
        start = time.perf_counter() - origin
        sent.append((prompt, max_tokens))
        await asyncio.sleep(0.01 if prompt == "a" else 0.03)
        return Sample(start, 0.001, [], [], time.perf_counter() - origin - start, 4)

    load = Load("run", 7, num_streams=2, requests_per_stream=2)
    window = Window(multiprocessing.get_context("spawn"))
    samples = asyncio.run(drive(load, load.share(0, 1), PromptSet("test", ("a", "b")), window, send,
                                time.perf_counter()))
    assert sent[:2] == [("a", 4), ("b", 7)] and all(tokens is None for _, tokens in sent[2:])
    assert len(samples) == 4 and all(s.start >= window.start for s in samples)


def test_prompt_sets_unique_and_synthetic():
    code = PromptSet("code", ("x = 1\n", "y = 2\n"), unique=True, nonce="n")
    assert code.prompt("r", 0) != code.prompt("r", 2) and code.prompt("r", 2).endswith("x = 1\n")
    assert code.prompt("r", 0).splitlines()[0] != code.prompt("s", 0).splitlines()[0]  # runs differ too
    synthetic = PromptSet("synthetic", input_len=100, input_len_range=0.2, vocab_size=50, nonce="n")
    prompts = [synthetic.prompt("r", k) for k in range(50)]
    assert all(80 <= len(p) <= 120 and all(0 <= t < 50 for t in p) for p in prompts)
    assert len({tuple(p[:8]) for p in prompts}) == 50  # no two share a first block
    assert synthetic.prompt("r", 3) == prompts[3]  # the served and in-process runs send the same


def test_output_lengths_spread_per_request():
    """--max-tokens-range: each counted request its own max_tokens, uniform in M (1 +- R), the
    same for a request index in every run of that name (served and in-process send the same);
    the warm-ups keep theirs; with R = 0 every request leaves max_tokens to the sampling."""
    load = Load("run", 100, num_streams=2, requests_per_stream=40, max_tokens_range=0.5)
    lengths = [load.output_tokens(k) for k in range(400)]
    assert all(50 <= n <= 150 for n in lengths) and min(lengths) < 60 and max(lengths) > 140
    assert abs(sum(lengths) / len(lengths) - 100) < 6
    assert lengths == [load.output_tokens(k) for k in range(400)]
    assert Load("run", 100).output_tokens(3) is None
    sent: list[tuple[str, int | None]] = []

    async def send(prompt: str, origin: float, max_tokens: int | None = None) -> Sample:
        sent.append((prompt, max_tokens))
        await asyncio.sleep(0.001)
        return Sample(time.perf_counter() - origin, 0.001, [], [], 0.001, max_tokens or 0)

    window = Window(multiprocessing.get_context("spawn"))
    prompts = PromptSet("test", ("a",), unique=True, nonce="n")  # first line: "# request n-run-<index>"
    asyncio.run(drive(load, load.share(0, 1), prompts, window, send, time.perf_counter()))
    assert [n for _, n in sent[:2]] == [50, 100]  # the warm-ups: 1/2 and 2/2 of max_tokens
    counted = {int(prompt.splitlines()[0].rsplit("-", 1)[1]): n for prompt, n in sent[2:]}
    assert len(counted) >= 80 and all(n == load.output_tokens(k) for k, n in counted.items())


def test_arrival_times():
    assert arrival_times(4, 5, None, 1.0, True, 0) == pytest.approx((0, 0.25, 0.5, 0.75, 1.0))
    assert arrival_times(4, None, 1.0, 1.0, True, 0) == pytest.approx((0, 0.25, 0.5, 0.75))
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5)):  # gamma gaps: coefficient of variation 1 / sqrt(shape)
        times = arrival_times(10, 4000, None, burstiness, False, 1)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.08)


def test_goodput_counts_the_requests_that_met_every_target():
    def request(ttft: float, e2e: float, tokens: int) -> Sample:
        return Sample(0.0, ttft, [], [], e2e, tokens)

    samples = [request(0.05, 0.45, 5),   # mean ITL (0.45 - 0.05) / 4 = 0.1: meets all
               request(0.30, 0.70, 5),   # TTFT over
               request(0.05, 0.85, 5),   # mean ITL 0.2 over
               request(0.10, 0.50, 3),   # mean ITL 0.2 over
               request(0.10, 0.10, 1),   # one token: no ITL; meets all
               request(0.01, 1.50, 20)]  # mean ITL 0.078; e2e over
    targets = dict(map(parse_goodput_target, ["ttft:200", "itl:150", "e2e:1000"]))
    result = goodput(samples, 2.0, targets)
    assert result["targets_ms"] == {"ttft": 200, "itl": 150, "e2e": 1000}
    assert result["num_requests"] == 2 and result["fraction"] == 2 / 6
    assert result["requests_per_s"] == 1.0 and result["output_tokens_per_s"] == (5 + 1) / 2.0
    assert goodput(samples, 2.0, {"ttft": 0.2})["num_requests"] == 5
    with pytest.raises(Exception):
        parse_goodput_target("tpot:10")


def test_metrics_delta():
    before = {"a_total": ("counter", 2.0), "lat_seconds_count": ("histogram", 1.0),
              'lat_seconds_bucket{le="1.0"}': ("histogram", 1.0), "free": ("gauge", 3.0),
              'deltaspec_spec_accepted_tokens_total{position="1"}': ("counter", 1.0),
              'deltaspec_spec_draft_tokens_total{position="1"}': ("counter", 2.0)}
    after = {**before, "a_total": ("counter", 5.0), "lat_seconds_count": ("histogram", 4.0), "free": ("gauge", 1.0),
             'deltaspec_spec_accepted_tokens_total{position="1"}': ("counter", 4.0),
             'deltaspec_spec_draft_tokens_total{position="1"}': ("counter", 6.0),
             "new_total": ("counter", 7.0)}
    delta = metrics_delta(before, after)
    assert delta["counters"] == {"a_total": 3.0, "lat_seconds_count": 3.0, 'lat_seconds_bucket{le="1.0"}': 0.0,
                                 "new_total": 7.0,
                                 'deltaspec_spec_accepted_tokens_total{position="1"}': 3.0,
                                 'deltaspec_spec_draft_tokens_total{position="1"}': 4.0}
    assert delta["gauges"] == {"free": 1.0} and delta["spec_acceptance_rate"] == 3 / 4


def test_a_sample_s_token_times_cost_the_garbage_collector_nothing_per_token():
    """A client keeps every request's times: as lists, a full collection walked them all (tens of
    ms in which the client read nothing, measured as the server's latency)."""
    times = [10.0 + 0.001 * i for i in range(300)]
    s = sample(9.99, times, 300, origin=9.0)
    assert list(s.itls) == pytest.approx([0.001] * 299) and s.token_times[0] == pytest.approx(1.0)
    assert s.ttft == pytest.approx(0.01) and s.e2e == pytest.approx(0.309)
    assert len(gc.get_referents(s.itls)) <= 1 and len(gc.get_referents(s.token_times)) <= 1


def test_server_timings_from_a_run_s_metric_deltas():
    counters = {'deltaspec_step_seconds_count{kind="decode"}': 10.0,
                'deltaspec_step_seconds_sum{kind="decode"}': 0.02,
                'deltaspec_step_seconds_bucket{kind="decode",le="0.005"}': 9.0,
                'deltaspec_step_seconds_count{kind="admit"}': 0.0,
                'deltaspec_gc_pause_seconds_count{generation="0",process="engine"}': 7.0,
                'deltaspec_gc_pause_seconds_bucket{generation="0",le="0.02",process="engine"}': 6.0,
                'deltaspec_gc_pause_seconds_count{generation="2",process="engine"}': 2.0,
                'deltaspec_gc_pause_seconds_bucket{generation="2",le="0.02",process="engine"}': 0.0,
                'deltaspec_gc_pause_seconds_count{generation="2",process="server"}': 1.0,
                'deltaspec_gc_pause_seconds_bucket{generation="2",le="0.02",process="server"}': 1.0,
                'deltaspec_process_cpu_seconds_total{process="engine"}': 3.0,
                'deltaspec_process_cpu_seconds_total{process="server"}': 1.5}
    timings = server_timings(counters, 4.0)
    assert timings["steps"] == {"decode": {"count": 10.0, "mean_s": pytest.approx(0.002), "share_within": 0.9}}
    assert timings["gc_pauses_past"] == {"engine": 3.0, "server": 0.0}  # past 20 ms: 1 young, 2 full; none
    assert timings["cpu_fraction"] == {"engine": 0.75, "server": 0.375}
    assert server_timings({}, 1.0) == {"steps": {}, "step_within_s": 0.005, "gc_pauses_past": {},
                                       "gc_pause_past_s": 0.02, "cpu_fraction": {}}


def test_host_load_between_two_readings():
    """busy CPUs: every tick but idle, iowait and steal, per second; steal over all ticks."""
    ticks = os.sysconf("SC_CLK_TCK")
    before = (100.0, 0.0, 50.0, 1000.0, 10.0, 0.0, 0.0, 0.0)
    # Over 2 s: 3 CPUs' worth of user + system, 1 of idle, 0.5 of iowait, 0.5 of steal.
    after = (before[0] + 4 * ticks, 0.0, before[2] + 2 * ticks, before[3] + 2 * ticks, before[4] + ticks, 0.0, 0.0,
             1.0 * ticks)
    load = host_load(before, after, 2.0)
    assert load["busy_cpus"] == pytest.approx(3.0)  # user + system: 6 CPU-seconds over 2 s
    assert load["steal_share"] == pytest.approx(1 / 10)
    assert host_load(None, after, 2.0) is None
    assert host_cpu_times() is None or len(host_cpu_times()) == 8
