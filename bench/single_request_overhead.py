"""Does the single-request path pay for speculation? Decode tokens/s at batch 1 (CUDA graphs,
speculation off) of this tree against an older tree of the engine (the one before speculation
landed), same GPU, same run, same random Qwen3.5-0.8B-like weights, alternating processes.
Writes bench/results/single_request_overhead-<gpu>.json.

    git archive 918c7df | tar -x -C .prev    # the tree before MTP speculation (issue 6)
    python bench/single_request_overhead.py --baseline .prev [--rounds 3] [--eager]

Each measurement runs in a fresh process whose `deltaspec` package points at one tree
(symlinks, as bench/device_setup.sh makes them), builds the model with that tree's own
bench/engine_throughput.py `build` (HF init under a fixed seed) and times `EngineCore.step`
over a 128-token prompt's decode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import commit_id, device_tag

PROMPT, STEPS = 128, 256


def worker(graphs: bool) -> None:
    """Runs inside a process whose deltaspec is one tree; prints tokens/s as JSON."""
    import time

    import torch

    sys.path.insert(0, str(Path.cwd() / "bench"))
    sys.path.insert(0, str(Path.cwd() / "tests"))
    from engine_throughput import build
    from fixtures import make_tokenizer

    from deltaspec.engine import EngineConfig, SamplingParams
    from deltaspec.engine.core import EngineCore
    from deltaspec.engine.tokenizer import Tokenizer

    torch.manual_seed(0)
    _, model, _ = build("0.8b")
    tokenizer = Tokenizer.from_dir(make_tokenizer(Path(tempfile.mkdtemp())))
    core = EngineCore(EngineConfig(model=".", device="cuda", dtype="bfloat16", max_num_seqs=1,
                                   max_model_len=PROMPT + STEPS + 16, gpu_memory_utilization=0.3,
                                   enable_cuda_graphs=graphs),
                      model=model, tokenizer=tokenizer)
    prompt = torch.randint(0, 248320, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    rates = []
    for _ in range(4):
        request = core.add_request(prompt, params)
        core.step()  # the prefill
        torch.cuda.synchronize()
        begin = time.perf_counter()
        while core.has_work:
            core.step()
        rates.append((len(request.output_token_ids) - 1) / (time.perf_counter() - begin))
    print(json.dumps({"tokens_per_s": statistics.median(rates[1:]), "graphs": core.runner.graphs is not None}))


def shim(tree: Path) -> Path:
    """A directory holding a `deltaspec` package made of symlinks to `tree`'s top folders."""
    root = Path(tempfile.mkdtemp()) / "deltaspec"
    root.mkdir()
    (root / "__init__.py").touch()
    for name in ("engine", "spec", "kernels", "server"):
        (root / name).symlink_to(tree.resolve() / name)
    return root.parent


def measure(tree: Path, graphs: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim(tree))] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                               if p and "shim" not in p])
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"] + ([] if graphs else ["--eager"]),
                         cwd=tree, env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"worker in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", type=Path, help="tree of the engine before speculation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs in either tree (the host path too)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.worker:
        worker(not args.eager)
        return
    import torch

    current = Path(__file__).resolve().parent.parent
    runs = {"current": [], "baseline": []}
    for _ in range(args.rounds):  # alternate, so drift hits both alike
        runs["baseline"].append(measure(args.baseline, not args.eager)["tokens_per_s"])
        runs["current"].append(measure(current, not args.eager)["tokens_per_s"])
    name = torch.cuda.get_device_name()
    current_rate, baseline_rate = statistics.median(runs["current"]), statistics.median(runs["baseline"])
    report = {"benchmark": "single_request_overhead", "device": name,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "baseline_tree": str(args.baseline), "command": " ".join(["python"] + sys.argv),
              "shape": "0.8b", "dtype": "bfloat16", "batch": 1, "cuda_graphs": not args.eager, "prompt_tokens": PROMPT, "decode_steps": STEPS,
              "tokens_per_s": runs, "current_tokens_per_s": current_rate, "baseline_tokens_per_s": baseline_rate,
              "current_over_baseline": current_rate / baseline_rate, "target": ">= 0.97"}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"single_request_overhead{'-eager' if args.eager else ''}-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
