"""The adaptive draft policy (spec/adaptive.py) simulated at batch 1: one request whose verify
steps accept as a per-position profile says, step costs from a measured table with 3% one-sided
noise, and the policy's real `choose` / `observe` / `AcceptanceEstimate.record`, for several
smoothing weights. No engine and no GPU: it shows how much of the fixed K's speedup the
policy's own estimates give away (the GPU figure is bench/spec_e2e.py's).

    python bench/tools/policy_sim.py [--smoothing 0.3,0.2,0.15,0.1] [--runs 40] [--tokens 512]

Cases: the shipped and published profiles alone, a profile that does not pay ("bad": 0.3 / 0.1
/ 0.03), and requests that switch between two profiles every N tokens. Step costs: the 0.8B
shape's batch-1 graph steps on an H100 at d402836 (results/spec_e2e_0.8b-h100.json), K = 0..3.
Prints and writes bench/results/policy_sim-cpu.json: per case, the mean and 10th-percentile
speedup over plain decoding across runs, and fixed K = 3's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import commit_id  # noqa: E402
from deltaspec.spec.adaptive import DraftPolicy, StepCosts  # noqa: E402

STEP_SECONDS = {0: 1.16e-3, 1: 1.50e-3, 2: 1.77e-3, 3: 2.04e-3}  # 0.8B, batch 1, H100, d402836


def conditional(by_position: list[float]) -> list[float]:
    previous = [1.0, *by_position[:-1]]
    return [p / q for p, q in zip(by_position, previous)]


PROFILES = {"shipped": [0.92, 0.75, 0.64], "published": [0.76, 0.62, 0.51], "bad": [0.3, 0.1, 0.03]}
CASES = {"shipped": (["shipped"], 0), "published": (["published"], 0), "bad": (["bad"], 0),
         "shipped/bad every 32": (["shipped", "bad"], 32), "shipped/bad every 128": (["shipped", "bad"], 128),
         "published/bad every 64": (["published", "bad"], 64)}


def simulate(seed: int, smoothing: float | None, profiles: list[str], every: int, tokens: int) -> float:
    """Tokens per plain step's time of one request generating `tokens`; smoothing None: fixed K = 3."""
    rng = random.Random(seed)
    costs = StepCosts((1,), {(1, k): s for k, s in STEP_SECONDS.items()})
    policy = DraftPolicy(3, costs, smoothing=smoothing or 0.3, adaptive=smoothing is not None)
    estimate = policy.new_estimate()
    made, seconds = 0, 0.0
    while made < tokens:
        accept = conditional(PROFILES[profiles[(made // every) % len(profiles)] if every else profiles[0]])
        k = policy.choose([estimate], [min(3, tokens - made - 1)], limit=tokens)
        accepted = 0
        while accepted < k and rng.random() < accept[accepted]:
            accepted += 1
        estimate.record(k, accepted, policy.smoothing)
        step = STEP_SECONDS[k] * (1 + 0.03 * abs(rng.gauss(0, 1)))
        policy.observe(1, k, step)
        made, seconds = made + accepted + 1, seconds + step
    return made / seconds * STEP_SECONDS[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoothing", default="0.3,0.2,0.15,0.1")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    settings = {"k=3": None, **{f"smoothing={s}": float(s) for s in args.smoothing.split(",")}}
    results = {}
    for name, smoothing in settings.items():
        results[name] = {}
        for case, (profiles, every) in CASES.items():
            runs = sorted(simulate(seed, smoothing, profiles, every, args.tokens) for seed in range(args.runs))
            results[name][case] = {"mean": statistics.fmean(runs), "p10": runs[len(runs) // 10]}
        print(f"{name:16s} " + "  ".join(f"{case}: {r['mean']:.2f} ({r['p10']:.2f})"
                                          for case, r in results[name].items()))
    report = {"benchmark": "policy_sim", "device": "cpu (simulation)", "commit": commit_id(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "step_seconds": STEP_SECONDS, "profiles": PROFILES,
              "tokens": args.tokens, "runs": args.runs, "speedup_over_plain": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_sim-cpu.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
