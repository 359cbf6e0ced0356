"""The engine's host loop under a closed-loop load, on the CPU, without the model: how many
admitting steps (steps with prefill chunks or cached rows) a run takes per request, and what
each kind of step costs the host.

    python bench/tools/admission_loop.py [--streams 16] [--steps 4000] [--drafts 0] [--out DIR]
        -> DIR/admission_loop-cpu.json

Each of --streams streams sends a request (200 random prompt tokens, --output-tokens LOW HIGH
output tokens, uniform, default 32-96, ignore_eos) and its next one as soon as the last
finishes, as `deltaspec bench serve`'s closed loop does; the engine is host_overhead's
(build_core: prefix cache off) with its FakeRunner (a step's outputs at once), so only the
engine's own host work runs. On a GPU every admitting step costs a few milliseconds of host
work whatever its rows (the prefill's launch, the first tokens' draw), so how requests that
finish on neighbouring steps share admitting steps matters as much as what one costs: with
async scheduling that depends on where the engine admits (the step planned ahead, or a step
scheduled after the pipeline drained), and on the output lengths (all equal, plain streams
that finish on one step stay in step and share every admission after). To compare two trees,
copy this file, bench/host_overhead.py and bench/common.py into the other tree's bench/ and run
it there with that tree's package on the path (bench/tools/ab.sh does the latter).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from fixtures import CORPUS, make_checkpoint  # noqa: E402

from common import closed_loop, write_result  # noqa: E402
from deltaspec.engine import SamplingParams  # noqa: E402
from host_overhead import FakeRunner, build_core  # noqa: E402

PROMPT_TOKENS = 200
OUTPUT_TOKENS = (32, 96)  # the default range of a request's output tokens


def run(streams: int, steps: int, drafts: int, seed: int, output_tokens: tuple[int, int] = OUTPUT_TOKENS) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        core = build_core(make_checkpoint(Path(directory), "qwen3_5"), drafts, max(64, streams), async_scheduling=True)
    core.runner = FakeRunner(core.tokenizer.encode("".join(CORPUS)), bool(drafts), seed)
    generator = random.Random(seed)
    vocab = core.model_config.vocab_size

    def send() -> None:
        core.add_request([generator.randrange(vocab) for _ in range(PROMPT_TOKENS)],
                         SamplingParams(max_tokens=generator.randint(*output_tokens), temperature=0.0,
                                        ignore_eos=True))

    for _ in range(streams):
        send()
    seconds: dict[str, list[float]] = {"decode": [], "admit": []}
    by_drafts: Counter[int] = Counter()  # decode steps by their draft count K
    requests = 0
    for plan, host_seconds, finished in closed_loop(core, send, steps):
        kind = "admit" if plan.prefill_rows or plan.cached_rows else "decode"  # runs in older trees too
        seconds[kind].append(host_seconds)
        if kind == "decode":
            by_drafts[max(r.num_draft_tokens for r in plan.decode_rows)] += 1
        requests += finished
    return {"streams": streams, "steps": steps, "drafts": drafts, "output_tokens": list(output_tokens),
            "finished_requests": requests,
            "admitting_steps": len(seconds["admit"]),
            "admitting_steps_per_request": round(len(seconds["admit"]) / max(requests, 1), 3),
            "decode_steps_by_drafts": dict(sorted(by_drafts.items())),
            **{f"{kind}_host_us": {"median": round(statistics.median(values) * 1e6, 1),
                                   "mean": round(statistics.mean(values) * 1e6, 1)}
               for kind, values in seconds.items() if values},
            "total_host_ms": round(sum(sum(values) for values in seconds.values()) * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--drafts", type=int, default=0, help="num_draft_tokens (0: no speculation)")
    parser.add_argument("--output-tokens", type=int, nargs=2, default=OUTPUT_TOKENS, metavar=("LOW", "HIGH"),
                        help="each request's output tokens, uniform in [LOW, HIGH] (LOW = HIGH: all equal)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args()
    result = run(args.streams, args.steps, args.drafts, args.seed, tuple(args.output_tokens))
    print(result)
    write_result(args.out, "admission_loop", "cpu", result)


if __name__ == "__main__":
    main()
