"""bench/sampling_cost.py's CPU smoke mode (a tiny shape, a few rows and steps): the script runs
every mix with and without speculation through the engine and writes its JSON. Its numbers mean
nothing on the CPU; the GPU run is the measurement."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sampling_cost.py"


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
