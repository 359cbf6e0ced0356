"""The killed-worker scenario, run in a process of its own by the GPU test (test_tensor_parallel):
a rank killed mid-request leaves a kernel of rank 0 waiting for it on the device, which only
that process's exit ends, so the scenario must not share the test session's process.

    python killed_worker.py CHECKPOINT ALL_REDUCE     -> one JSON line on stdout

The line holds what the test checks: the error (its type and message) and how long it took to
come, the tokens handed out and one GPU's tokens for the same request, how long close took and
whether any worker process was left."""

import faulthandler
import json
import os
import signal
import sys
import time

from deltaspec.engine import LLM, SamplingParams
from deltaspec.engine.executor import WorkerDiedError


def main(path: str, all_reduce: str) -> dict:
    prompt = list(range(7, 17))
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    options = dict(device="cuda", max_num_seqs=4, max_model_len=512)
    with LLM(path, num_draft_tokens=0, **options) as one:
        expected = one.generate([prompt], params)[0].token_ids
    llm = LLM(path, tensor_parallel_size=2, num_draft_tokens=2, all_reduce=all_reduce, **options)
    core = llm.core
    result = {"all_reduce_kind": core.tp.all_reduce_kind, "expected": expected}
    request = core.add_request(prompt, params)
    for _ in range(3):
        core.step()
    os.kill(core.workers.processes[0].pid, signal.SIGKILL)
    started = time.monotonic()
    try:
        while True:
            core.step()
    except WorkerDiedError as error:
        result["error"] = f"WorkerDiedError: {error}"
    except Exception as error:  # noqa: BLE001 - the test reports whatever came instead
        result["error"] = f"{type(error).__name__}: {error}"
    result["error_after_s"] = time.monotonic() - started
    result["tokens"] = list(request.output_token_ids)
    started = time.monotonic()
    llm.close()
    result["close_s"] = time.monotonic() - started
    result["workers_left"] = sum(p.is_alive() for p in core.workers.processes)
    return result


if __name__ == "__main__":
    # A hang shows where: every thread's stack on stderr, then exit, before the test's timeout.
    faulthandler.dump_traceback_later(180, exit=True)
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
