"""How long tokenizing a huge prompt in a worker thread can stall the event loop's thread: the
largest gap a thread sleeping 1 ms in a loop sees while another thread encodes a ~1 MiB prompt
(#33's abuse case) with the shipped model's tokenizer, four times, with and without
`max_length` (the context: the server's path, which refuses the prompt by its count and never
builds its ids' list). CPU only; the GIL, not the cores, is what is measured.

    python bench/tools/tokenize_stall.py [--out bench/results]

Writes tokenize_stall-cpu.json (date, commit, command, gaps in ms).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from pathlib import Path

from deltaspec.engine.tokenizer import Tokenizer, TooManyTokensError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from common import commit_id  # noqa: E402
LINE = "# " + "x" * 70 + "\n"  # code-like text, as `deltaspec bench serve --abuse` sends


def largest_gap_ms(tokenizer: Tokenizer, text: str, max_length: int | None, repeats: int = 4) -> dict:
    gaps: list[float] = []
    done = threading.Event()

    def probe() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.05)
    for _ in range(repeats):
        try:
            tokenizer.encode(text, max_length=max_length)
        except TooManyTokensError:
            pass
    done.set()
    thread.join()
    gaps.sort()
    return {"max_length": max_length, "largest_gap_ms": 1e3 * gaps[-1], "p99_gap_ms": 1e3 * gaps[int(0.99 * len(gaps))]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(ROOT / "models" / "default")
    text = LINE * ((1 << 20) // len(LINE))
    num_ids = len(tokenizer.encode(text))
    runs = [largest_gap_ms(tokenizer, text, limit) for limit in (None, 4096)]
    report = {"benchmark": "tokenize_stall", "device": "cpu",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "prompt_chars": len(text),
              "prompt_ids": num_ids, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenize_stall-cpu.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
