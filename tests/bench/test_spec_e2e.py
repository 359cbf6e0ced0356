"""bench/spec_e2e.py's narrowed run (--fixed, --profiles: the A/B of two trees in one device call)
on the tiny shape on the CPU: plain, the fixed draft counts asked for and adaptive, for the
profiles asked for, and nothing else."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_spec_e2e_runs_only_the_settings_asked_for(tmp_path):
    subprocess.run([sys.executable, str(BENCH / "spec_e2e.py"), "--shapes", "tiny", "--batches", "1", "--device", "cpu",
                    "--tokens", "8", "--fixed", "2", "--profiles", "shipped", "--temperatures", "0",
                    "--out", str(tmp_path)], check=True, capture_output=True)
    report = json.loads((tmp_path / "spec_e2e-cpu.json").read_text())
    assert set(report["profiles"]) == {"shipped"}
    variants = report["shapes"]["tiny"]["variants"]
    assert set(variants) == {"full"}
    result = variants["full"]["shipped"]
    assert set(result["tokens_per_s"]) == {"plain", "k=2", "adaptive"}
    assert set(result["speedup"]) == {"k=2", "adaptive"}
    assert all(value > 0 for values in result["tokens_per_s"].values() for value in values.values())
