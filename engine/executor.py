"""Tensor-parallel worker processes: ranks 1..tp-1, each running its shard of every step.

Rank 0 (the caller's process) keeps the scheduler, tokenizer, prefix cache decisions and front
ends; it starts one spawned process per other rank (one GPU each; gloo on the CPU). Each worker
builds the same EngineCore as rank 0, on its shard (the model, its share of the state and KV
pools, its own CUDA graphs: the constructor's collectives, pool sizing and graph captures, run
in the same order on every rank), then serves the device calls rank 0 makes: the executor
boundary is the Runner. `ParallelRunner` sends each call (a StepPlan with its requests reduced
to what the device needs, `RowRequest`) down a pipe to every worker and runs it itself; every
rank computes the full logits and samples the same tokens, so the steps launched ahead (fed
from the device), speculation's draft, verify, accept and rollback need no further messages,
and only rank 0's outputs are read.

Failure: a worker that raises exits; a monitor thread sees a worker's process end and aborts
the process group (TensorParallel.abort: NCCL's communicators, and a stand-in for the dead peer
at the symmetric-memory all-reduce's barriers), so rank 0's collective in flight ends at once
(gloo fails on a closed peer by itself), and every call after it raises WorkerDiedError naming
the rank; a call that fails on rank 0 alone stops the workers too (TensorParallelError: the
ranks' collectives no longer pair up). Workers ignore Ctrl-C (rank 0 shuts them down) and exit
when rank 0's end of their pipe closes or rank 0's process is gone. Shutdown: rank 0 tells the
workers to close and every rank leaves the group at once (TensorParallel.leave: an NCCL abort,
which on one host synchronizes with the peers' aborts), unless the monitor is already aborting
it (close waits 10 s at most for that abort). Knows nothing about scheduling or models.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Sequence

import msgspec
import torch
import torch.distributed as dist

from .runner import InFlight
from .sampling_params import SamplingParams
from .step import ScheduledRow, StepPlan
from .tensor_parallel import COLLECTIVE_TIMEOUT, TensorParallel, abort_nccl
from .vision.prompt import PromptImages

logger = logging.getLogger("deltaspec")

JOIN_TIMEOUT_S = 10.0  # a closing worker gets this long before it is killed
ABORT_TIMEOUT_S = 10.0  # the monitor's abort of the group, which close waits for
_JOINED = "deltaspec/workers_joined"  # store counter: workers that reached rank 0's store


class TensorParallelError(RuntimeError):
    """The ranks can no longer run steps together: the engine cannot run another step."""


class WorkerDiedError(TensorParallelError):
    """A tensor-parallel worker process ended."""


class RowRequest(msgspec.Struct, frozen=True, gc=False):
    """What the device side reads of a row's request (Sampler, Penalties, the MTP inputs):
    its parameters and seed, and of its tokens the window [tokens_start, tokens_start +
    len(tokens)) the row's MTP catch-up reads, or all of them for a penalized request (its
    statistics are built from them), widened to the prompt tokens its prompt_logprob_span scores."""

    request_id: str
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    num_prompt_tokens: int
    tokens_start: int
    tokens: list[int]
    grammar: None = None  # the matchers stay on rank 0, which broadcasts each step's masks
    # Where the prompt's images sit, their pixels left out (rank 0 broadcasts the encoder's
    # outputs): prefill and cached rows only, which place image tokens and set the RoPE shift.
    images: PromptImages | None = None

    @classmethod
    def of(cls, row: ScheduledRow, with_images: bool = False) -> "RowRequest":
        request = row.request
        if request.params.penalized:
            start, end = 0, request.num_tokens
        else:
            start, end = row.mtp_start + 1, max(row.mtp_start + 1, row.mtp_end + 1)
            first, last = row.prompt_logprob_span
            if first < last:
                start, end = min(start, first + 1), max(end, last + 1)
        images = request.images.without_pixels() if with_images and request.images is not None else None
        return cls(request.request_id, request.params, request.seed, request.stop_token_ids,
                   request.bad_words_token_ids, len(request.prompt_token_ids), start, request.token_ids(start, end),
                   images=images)

    def token_ids(self, start: int, end: int) -> list[int]:
        if start < self.tokens_start or end - self.tokens_start > len(self.tokens):
            raise RuntimeError(f"request {self.request_id}: tokens [{start}, {end}) were not sent to the worker")
        return self.tokens[start - self.tokens_start:end - self.tokens_start]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids(0, self.num_prompt_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids(self.num_prompt_tokens, self.tokens_start + len(self.tokens))


def plan_for_workers(plan: StepPlan) -> StepPlan:
    """The plan as the workers run it: rows carry RowRequests; nothing rank 0 keeps for commit."""
    def rows(scheduled: Sequence[ScheduledRow], with_images: bool = False) -> tuple[ScheduledRow, ...]:
        return tuple(msgspec.structs.replace(r, request=RowRequest.of(r, with_images)) for r in scheduled)

    return dataclasses.replace(plan, decode_rows=rows(plan.decode_rows), prefill_rows=rows(plan.prefill_rows, True),
                               cached_rows=rows(plan.cached_rows, True), pinned=(), writes=())


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:(i + r) for cuda[:i]; the CPU for every rank on the CPU."""
    d = torch.device(device)
    return f"cuda:{(d.index or 0) + rank}" if d.type == "cuda" else "cpu"


class Workers:
    """Rank 0's handle on the worker processes."""

    def __init__(self, config, forced_acceptance=None) -> None:
        """Spawn ranks 1..tp-1 for `config` (an EngineConfig); rank 0 joins the group next
        (`join`), which returns when every worker has joined."""
        size = config.tensor_parallel_size
        device = torch.device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
            raise ValueError(f"tensor_parallel_size={size} on {config.device} needs cuda:{device.index or 0}.."
                             f"cuda:{(device.index or 0) + size - 1}; {torch.cuda.device_count()} CUDA devices are "
                             f"visible (CUDA_VISIBLE_DEVICES picks them)")
        self.size, self.closing = size, False
        self.group: TensorParallel | None = None  # rank 0's, once it has joined
        # Why no step can run any more: (the error to raise, its message); None while all is well.
        self.dead: tuple[type[TensorParallelError], str] | None = None
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=COLLECTIVE_TIMEOUT)
        context = mp.get_context("spawn")
        self.processes, self.pipes = [], []
        for rank in range(1, size):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, name=f"deltaspec-tp{rank}", daemon=True,
                                      args=(config, rank, self.store.port, child, forced_acceptance,
                                            # Workers repeat rank 0's start-up lines: warnings only.
                                            max(logging.getLogger("deltaspec").getEffectiveLevel(), logging.WARNING),
                                            os.getpid()))
            process.start()
            child.close()
            self.processes.append(process)
            self.pipes.append(parent)
        self._abort_started = False
        self._closing_lock = threading.Lock()  # `closing` and `_abort_started`: one of them is set first
        self._monitor = threading.Thread(target=self._watch, name="deltaspec-tp-monitor", daemon=True)
        self._monitor.start()
        atexit.register(self._exit_if_abort_stuck)

    def join(self, device: torch.device) -> TensorParallel:
        """Join the group once every worker has reached the store (a worker that dies first
        raises WorkerDiedError instead of a rendezvous timeout)."""
        while self.store.add(_JOINED, 0) < self.size - 1:
            self.check()
            time.sleep(0.05)
        self.group = TensorParallel.join(0, self.size, device, self.store)
        return self.group

    def send(self, method: str, *args) -> None:
        """Have every worker run `method(*args)` of its runner (in the order sent)."""
        self.check()
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(message)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._died(rank)
                self.check()

    def check(self, grace: float = 0.0) -> None:
        """Raise WorkerDiedError when a worker has ended; grace: first wait up to that many
        seconds for one to end (a collective that failed on a closed peer)."""
        if self.dead is None:
            ended = multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout=grace)
            for rank, process in enumerate(self.processes, start=1):
                if process.sentinel in ended:
                    self._died(rank)
                    break
        if self.dead is not None:
            raise self.dead[0](self.dead[1])

    def _died(self, rank: int) -> None:
        if self.dead is None:
            process = self.processes[rank - 1]
            process.join(1.0)  # its pipe may close a moment before the process can be reaped
            code = process.exitcode
            self.dead = (WorkerDiedError, f"tensor-parallel worker rank {rank} (pid {process.pid}) died"
                         + (f" with exit code {code}" if code is not None else "") + "; the engine cannot continue")

    def _watch(self) -> None:
        """Wait for any worker's process to end; unless closing, mark the engine dead and abort
        the process group so a collective rank 0 is blocked in ends instead of hanging."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        with self._closing_lock:
            if self.closing:
                return
            self._abort_started = True
        self._died(sentinels[ready[0]])
        logger.error("%s", self.dead[1])
        try:
            if self.group is not None:
                self.group.abort()
            else:  # rank 0 is still joining
                abort_nccl()
        except Exception:  # noqa: BLE001 - best effort: the timeout still ends an NCCL collective
            logger.exception("could not abort the process group")

    def close(self) -> None:
        """Stop every worker (a close message, then terminate, then kill) and leave the group
        with them; idempotent. The workers leave as they close, rank 0 meanwhile, each after
        destroying its CUDA graphs (core._release): while graphs that captured the group's
        collectives existed, NCCL's abort waited 120 s (torch's limit) on 2 H100s (f57ba67)
        and on every rank of 4 H200s (76de151). While the monitor aborts the group because a
        worker died, leaving beside it races that abort on the same communicators (the
        killed-worker test hung there): close waits for it first, ABORT_TIMEOUT_S at most."""
        with self._closing_lock:
            if self.closing:
                return
            self.closing = True
        if self.dead is None:
            self.dead = (TensorParallelError, "the tensor-parallel workers were stopped (the engine was closed or "
                                              "failed)")
        for pipe in self.pipes:
            try:
                pipe.send_bytes(pickle.dumps(("close", ())))
            except OSError:
                pass
        if self._abort_started:
            self._monitor.join(ABORT_TIMEOUT_S)
        if self.aborting:
            logger.error("the process group's abort has not returned in %.0f s; its communicators stay until this "
                         "process exits", ABORT_TIMEOUT_S)
        elif self.group is not None:
            self.group.leave()  # after the monitor's abort: what the abort left (gloo's group)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        if not self.aborting:
            atexit.unregister(self._exit_if_abort_stuck)

    @property
    def aborting(self) -> bool:
        """The monitor's abort of the group has not returned (the group cannot be left)."""
        return self._abort_started and self._monitor.is_alive()

    def _exit_if_abort_stuck(self) -> None:
        """At interpreter exit, while the monitor's abort has not returned: NCCL's abort can
        wait for good on a kernel of this process that waits for the dead peer (2 H100s,
        6869226), and the C++ teardown at exit then ends the process with std::terminate
        (SIGABRT). End it here instead, with status 1 (a worker died) and the logs flushed."""
        if not self.aborting:
            return
        logger.error("the process group's abort has not returned; ending the process (exit status 1)")
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)


class ParallelRunner:
    """Rank 0's runner under tensor parallelism: every device call goes to the workers first
    (they run it on their shards, in the same order), then runs here. A failure while a worker
    is dead is reported as WorkerDiedError naming it, and so are outputs read after a worker
    died: on GPUs a collective whose peer is gone does not fail but hangs until the monitor
    aborts the process group, and then returns whatever its buffers held."""

    def __init__(self, runner, workers: Workers) -> None:
        self.runner, self.workers = runner, workers

    def launch(self, plan: StepPlan) -> InFlight:
        return self._call("launch", plan).checked(self.workers.check)

    def run(self, plan: StepPlan):
        output = self._call("run", plan)
        self.workers.check()
        return output

    def apply_cache_ops(self, ops):
        return self._call("apply_cache_ops", ops)

    def score(self, sequences: list[list[int]]):
        logits = self._call("score", sequences)
        self.workers.check()
        return logits

    def _call(self, method: str, arg):
        self.workers.send(method, plan_for_workers(arg) if isinstance(arg, StepPlan) else arg)
        try:
            return getattr(self.runner, method)(arg)
        except Exception as error:
            self.workers.check(grace=2.0)  # a collective that failed because a worker died: say so
            # Rank 0 stopped partway through a call the workers ran whole: their collectives no
            # longer pair with rank 0's, so no step can follow (on one device it could).
            self.workers.close()
            raise TensorParallelError(f"rank 0 failed in {method} ({type(error).__name__}: {error}); the ranks are "
                                      f"out of step and the engine cannot continue") from error


def _worker_main(config, rank: int, store_port: int, pipe, forced_acceptance, log_level: int,
                 parent_pid: int) -> None:
    from .core import EngineCore  # here: the spawned interpreter imports the engine once

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which shuts us down
    logging.basicConfig(level=log_level, format=f"%(asctime)s tp{rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        config = dataclasses.replace(config, device=rank_device(config.device, rank), warm_up=False)
        store = dist.TCPStore("127.0.0.1", store_port, config.tensor_parallel_size, is_master=False,
                              timeout=COLLECTIVE_TIMEOUT)
        store.add(_JOINED, 1)
        tp = TensorParallel.join(rank, config.tensor_parallel_size, torch.device(config.device), store)
        core = EngineCore(config, forced_acceptance=forced_acceptance, tp=tp)
        while True:
            try:
                method, args = pickle.loads(pipe.recv_bytes())
            except (EOFError, OSError):
                break  # rank 0 is gone
            if method == "close":
                break
            result = getattr(core.runner, method)(*args)
            if method == "launch":
                # Rank 0 decides a launched step's constrained rows before it launches the next
                # one (EngineCore.dispatch); here the same, at once (their masks come from rank 0).
                result.decide()
        core.close()  # its graphs, then the group
    except BaseException:  # noqa: BLE001 - rank 0 learns of it from the process's end
        traceback.print_exc()
        os._exit(1)  # no teardown: a collective may still hold this process's CUDA and NCCL state
    # No interpreter teardown either: it would free the symmetric-memory buffer, which
    # synchronizes the device, and a kernel of a step rank 0 stopped partway through still
    # waits there for rank 0's half of an all-reduce (the process's exit ends it).
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)
