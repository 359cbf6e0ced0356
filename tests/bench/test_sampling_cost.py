"""bench/sampling_cost.py's CPU smoke mode (a tiny shape, a few rows and steps): the script runs
every mix with and without speculation through the engine and writes its JSON. Its numbers mean
nothing on the CPU; the GPU run is the measurement. bench/sampling_host.py's counts of the
host's sampling work, which do not depend on the machine."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sampling_cost.py"
HOST_SCRIPT = SCRIPT.with_name("sampling_host.py")


def test_cpu_smoke_mode_writes_every_mix(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--batch", "3", "--steps", "2",
                    "--draft-tokens", "2", "--out", str(tmp_path)], check=True, timeout=600)
    result = json.loads((tmp_path / "sampling_cost-cpu.json").read_text())
    assert {"device", "date", "commit", "command"} <= result.keys()
    assert set(result["runs"]) == {"k=0", "k=2"}
    for run in result["runs"].values():
        assert set(run) == {"plain", "penalties", "schema", "penalties+schema", "plain_greedy"}
        assert all(mix["step_ms"] > 0 and mix["steps_measured"] == 2 for mix in run.values())
        assert run["plain"]["ratio_to_plain"] == 1.0
        for mix in run.values():
            assert set(mix["phases"]) == {"dispatch", "decide", "mask_wait", "launch", "result", "commit", "draw",
                                          "sample", "hand_over"}
            assert {"num_alloc_retries", "num_sync_all_streams"} <= mix["allocator"].keys()
            assert all(ms >= 0 for ms in mix["phases"].values())


def test_sampling_host_counts_the_sampling_work(tmp_path):
    out = tmp_path / "sampling_host.json"
    subprocess.run([sys.executable, str(HOST_SCRIPT), "--batch", "3", "--steps", "2", "--draft-tokens", "2",
                    "--label", "smoke", "--out", str(out)], check=True, timeout=600)
    result = json.loads(out.read_text())["runs"]["smoke"]
    assert {"date", "commit", "command"} <= result.keys()
    for run in result["results"].values():
        assert all(mix["steps_measured"] == 2 for mix in run.values())
        # greedy and plainly sampled rows are decided inside the step (its graph): no sampling work at all
        for mix in ("plain_greedy", "plain"):
            assert run[mix]["ops"] == 0 and run[mix]["copies_in"] == 0
        # penalties and a grammar add work to a sampled row; none of it is a copy from host lists per row
        assert run["penalties+schema"]["ops"] > 0
        assert run["penalties+schema"]["copies_in"] <= 2
