"""EngineCore: the model, its pools, the scheduler and the runner, driven one step at a time.

    step   = core.dispatch()          schedule (or take the step launched ahead); launch what needs no waiting
    result = step.wait()              device work (may run in a worker thread) -> StepResult
                                      (wait(on_device): on_device() once the step is launched)
    deltas = core.commit(step.plan, result)

`step()` is the three in a row. Both front ends (the sync `LLM` and `AsyncLLM`) drive this one
object; `schedule()` and `run(plan)` remain for callers that drive plans themselves.

Async scheduling (EngineConfig.async_scheduling): `wait` launches step n+1
(Scheduler.continuation: its rows fed step n's tokens on the device, and the waiting requests
admitted beside them) before it waits for step n's tokens, and returns that launched step in its
StepResult; `commit`, on the caller's thread, keeps it as the next step to dispatch. So the
host's scheduling, launching and committing hide behind the device's work instead of adding to
it, speculative steps and admissions too (their outputs, acceptance and first tokens included,
stay on the device until read one step late). What the continuation cannot plan (aborts,
preemption, a prompt's next chunk) drains the pipeline: that step is scheduled after the one
before it is committed, and launched with its own continuation. Pools are sized once at
start-up from the memory budget. Knows nothing about asyncio or HTTP.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import weakref
from pathlib import Path
from typing import Callable, NamedTuple, Sequence as Seq

import torch
import torch.distributed

from ..kernels import select_ops
from ..kernels.attention import FP8_KV
from ..spec import AcceptanceProfile, DraftPolicy, StepCosts, load_draft_vocab
from .allocators import BlockAllocator, SlotAllocator
from . import generation_defaults
from .checkpoint_io import CheckpointIO
from .cuda_graphs import DecodeGraphs, SpecGraphs
from .decode_step import DecodeStep
from .durations import Durations
from .engine_config import FP8_KV_CACHE_DTYPES, EngineConfig
from .executor import ParallelRunner, Workers, rank_device
from .model_config import ModelConfig
from .model_source import local_config
from .models import HybridLM
from .penalties import Penalties
from .prefill_graphs import Forward, PrefillGraphs
from .prefix_cache import CheckpointHandle, PrefixCache
from .request import NONFINITE_LOGITS, Request, RequestDelta
from .runner import InFlight, Runner
from .sampler import Sampler
from .sampling_params import SamplingParams
from .sampling_table import SamplingTable
from .scheduler import Scheduler, SchedulerConfig
from .sharding import check_divisible
from .speculation import DraftEditor, Speculator
from .state_pool import KVPool, StatePool
from .structured import Grammars
from .step import StepOutput, StepPlan
from .tokenizer import Tokenizer
from .tensor_parallel import TensorParallel
from .warm_up import num_compiles_after_warm_up, warm_up
from .quantization import ONLINE_METHODS, Fp8Config, describe as describe_quantization, with_quantization_option
from .vision.encoder import load_vision_encoder, random_vision_encoder
from .vision.features import ImageFeatures
from .vision.image import ImageInput, VideoInput
from .vision.preprocess import ImageProcessor
from .vision.prompt import PromptImages, expand_image_tokens
from .vision.video import VideoProcessor
from .weights import load_model, random_model

logger = logging.getLogger("deltaspec")

class StepResult(NamedTuple):
    """What waiting for a dispatched step gives: its output, and the step launched after it
    (before its tokens were read), if any, which becomes the next step to dispatch."""

    output: StepOutput
    launched: InFlight | None = None


class Dispatched(NamedTuple):
    """A step on its way: `wait(on_device=None)` returns its StepResult (blocking; safe in a
    worker thread), calling on_device() once the device has the step and the one launched
    ahead of it, before it blocks on the device (AsyncLLM hands the last step's deltas out
    then, so their consumers run while the device works)."""

    plan: StepPlan
    wait: Callable[..., StepResult]


MAX_DRAFT_TOKENS = 3  # drafts a step at most by default (EngineConfig.num_draft_tokens None)
CHECKPOINT_MEMORY_SHARE = 0.1  # of the pool budget, for prefix-cache checkpoint slots by default
# At most this many checkpoint slots by default. A real model's slot is MBs (~20 MB for Qwen3.5-0.8B)
# and the share bounds them; a toy model's is KBs, and this bounds the pool's start-up instead.
MAX_CHECKPOINT_SLOTS = 4096
# Bounds (seconds) of the step-time histogram (`stats()["step_seconds"]`).
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineCore:
    def __init__(self, config: EngineConfig, model: HybridLM | None = None, tokenizer: Tokenizer | None = None,
                 edit_drafts: DraftEditor | None = None, forced_acceptance: AcceptanceProfile | None = None,
                 tp: TensorParallel | None = None) -> None:
        """Loads model and tokenizer from config.model unless given (benchmarks build random
        models in memory; a given model must already be on config.device in config.dtype).
        edit_drafts: rewrites each speculative step's drafts before verify (tests force
        acceptance counts with it; speculation.py). It reads the requests' committed tokens, so
        no step is launched ahead of the one before it then. forced_acceptance: benchmarks at
        real sizes draw each verify row's accepted count from a profile (spec/profile.py).

        config.tensor_parallel_size > 1: this engine is rank 0 and starts the other ranks'
        worker processes (executor.py); tp: this engine is a worker's, of that rank (the
        workers build it themselves).

        config.model may name a Hugging Face Hub repo: it is downloaded (or found in the cache)
        first, once, and the workers read the local copy (model_source.py)."""
        config = local_config(config) if model is None else config.concrete(None)
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _TORCH_DTYPES[config.dtype]
        self.workers: Workers | None = None
        if tp is None and config.tensor_parallel_size > 1:
            if model is not None:
                raise ValueError("tensor_parallel_size > 1 loads the model on every rank: pass no model")
            if edit_drafts is not None:
                raise ValueError("a draft editor runs on rank 0 only: not supported with tensor_parallel_size > 1")
            if torch.distributed.is_initialized():
                raise ValueError("this process already runs a tensor-parallel engine (or another torch.distributed "
                                 "group): one per process; close it first (LLM.close, AsyncLLM.shutdown)")
            check_divisible(ModelConfig.from_file(Path(config.model)), config.tensor_parallel_size,
                            config.enable_expert_parallel)  # before any process starts
            self.workers = Workers(config, forced_acceptance)
        # Every rank's resources go together: a failed start-up, close() or the engine's
        # collection stops the workers and leaves the process group.
        group = [tp]  # filled in once rank 0 has joined
        self._runners: list[Runner] = []  # this rank's runner, once built: its graphs go first
        self._finalizer = weakref.finalize(self, _release, self.workers, group, self._runners)
        try:
            if self.workers is not None:
                tp = group[0] = self.workers.join(torch.device(rank_device(config.device, 0)))
            self.tp = tp
            if tp is not None:
                torch.manual_seed(0)  # device draws (forced acceptance) alike on every rank
            self._build(config, model, tokenizer, edit_drafts, forced_acceptance)
        except BaseException:
            try:
                if self.workers is not None:
                    # A worker that died during start-up (out of memory on its GPU): a collective
                    # of rank 0's failed or was aborted; name the rank instead.
                    self.workers.check(grace=2.0)
            finally:
                self.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing on one device)."""
        self._finalizer()

    def _build(self, config: EngineConfig, model: HybridLM | None, tokenizer: Tokenizer | None,
               edit_drafts: DraftEditor | None, forced_acceptance: AcceptanceProfile | None) -> None:
        path = Path(config.model)
        self.tokenizer = tokenizer or Tokenizer.from_dir(path)
        self.tokenizer.token_bytes  # the detokenizers' table, built now rather than by the first request
        # What a request's unset sampling fields become (SamplingParams.resolve).
        self.generation_defaults = generation_defaults.load(path, config.generation_config)
        logger.info("sampling defaults from generation_config.json: %s",
                    dict(self.generation_defaults) if self.generation_defaults else
                    f"none ({'off' if config.generation_config == 'none' else 'the file sets none'})")
        if model is None:
            self.model_config = ModelConfig.from_file(path)
            if config.quantization is not None:
                self.model_config = with_quantization_option(self.model_config, config.quantization)
            self.ops = select_ops(self.device, config.kernel_backend)
            if config.load_format == "dummy":
                self.model = random_model(self.model_config, self.ops, self.dtype, self.device, self.tp,
                                          config.enable_expert_parallel)
            else:
                self.model = load_model(path, self.ops, self.dtype, self.device, self.model_config,
                                        quantize_online=config.quantization in ONLINE_METHODS, tp=self.tp,
                                        expert_parallel=config.enable_expert_parallel)
        else:
            self.model, self.model_config, self.ops = model, model.config, model.ops
        logger.info("weights: %.2f GB on this device, %s", sum(p.nbytes for p in self.model.parameters()) / 1e9,
                    describe_quantization(self.model.config.quantization))
        self.image_processor, self.video_processor, image_features = self._vision(config, path, loaded=model is None)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.num_draft_tokens = self._draft_tokens()
        if self.tp is not None:
            # The largest message a decode or speculative graph all-reduces: [max_num_seqs x
            # (k + 1) tokens, hidden] (verify, the MTP catch-up); prefill chunks past it keep
            # NCCL. Before the pools take the free memory and before any capture.
            self.tp.use_symmetric_memory(config.all_reduce, self.dtype,
                                         config.max_num_seqs * (self.num_draft_tokens + 1),
                                         self.model_config.hidden_size)
        if self.num_draft_tokens and config.draft_vocab_size:
            self.model.use_draft_vocab(load_draft_vocab(path, config.draft_vocab_size))
        self.states, self.kv = self._allocate_pools()
        self.slots = SlotAllocator(self.states.num_slots)
        self.blocks = BlockAllocator(self.kv.num_blocks, config.block_size)
        # The size function must not capture self: an engine -> cache -> engine cycle would keep a
        # dropped engine's pools alive until Python's cyclic collector happens to run.
        slot_bytes, block_bytes = self.states.bytes_per_slot, self.kv.block_bytes
        self.cache = PrefixCache(self.slots, self.blocks, config.checkpoint_interval, config.enable_prefix_cache,
                                 mtp=bool(self.num_draft_tokens), host_capacity_bytes=config.host_cache_bytes,
                                 checkpoint_bytes=lambda n: slot_bytes + n * block_bytes)
        table = SamplingTable(self.states.num_slots, self.device)
        decode = DecodeStep(self.model, self.states, self.kv, config.block_size, bool(self.num_draft_tokens),
                            config.max_num_seqs, self._max_blocks_per_row, table)
        penalties = Penalties(config.max_num_seqs, self.model_config.vocab_size, self.device, self.ops)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        sampler = Sampler(self.ops, self.device, table, penalties, self.grammars, self.tp)
        checkpoint_io = CheckpointIO(self.states, self.kv)
        speculator = Speculator(self.model, self.states, self.kv, decode, sampler, checkpoint_io, edit_drafts,
                                forced_acceptance) if self.num_draft_tokens else None
        graphs = self._decode_graphs(decode)
        spec_graphs = self._spec_graphs(decode, speculator, split=edit_drafts is not None) if speculator else None
        # The forwards close over the model and pools, not self (an engine -> runner -> engine cycle).
        model, states, kv = self.model, self.states, self.kv
        prefill_graphs = self._prefill_graphs("target", lambda batch, _: model(batch, states, kv),
                                              config.checkpoint_interval, commit=speculator is None)
        mtp_prefill_graphs = self._prefill_graphs(
            "MTP", lambda batch, inputs: model.draft_hidden(batch.input_ids, inputs, batch, kv), None, commit=True,
            inputs=(self.model_config.hidden_size, self.dtype)) if speculator else None
        self.runner = Runner(self.model, self.states, self.kv, sampler, checkpoint_io, config.block_size, self.device,
                             decode, graphs=graphs, speculator=speculator, spec_graphs=spec_graphs,
                             prefill_graphs=prefill_graphs, mtp_prefill_graphs=mtp_prefill_graphs,
                             images=image_features)
        self._runners.append(self.runner)
        if self.workers is not None:
            self.runner = ParallelRunner(self.runner, self.workers)
        policy = None
        if self.num_draft_tokens:
            costs = self._step_costs(graphs, spec_graphs)
            policy = DraftPolicy(self.num_draft_tokens, costs, adaptive=config.adaptive_draft_length)
            logger.info("step costs (seconds by batch bucket; K=0 is plain decoding): %s", costs.as_dict())
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, self.num_draft_tokens,
                                                   config.scheduling_policy),
                                   self.slots, self.blocks, self.cache, policy)
        self._in_flight: InFlight | None = None  # launched by the last step's wait, next to dispatch
        self._ahead: StepPlan | None = None  # planned by the dispatched step, to be launched by its wait
        self._back_to_back = False  # the step being dispatched was launched ahead
        self._last_commit: float | None = None  # when the last commit began
        self._last_commit_seconds = 0.0         # and how long it took
        # Host seconds spent planning and launching the step launched ahead (`_ahead_host`) and
        # the step being dispatched (`_own_host`, the former once the step before is committed).
        self._ahead_host = self._own_host = 0.0
        self.step_times = _step_times()
        self._dispatched_at = 0.0
        self._overlap = config.async_scheduling and edit_drafts is None
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)  # what requests that set no seed draw (draw_seed)
        if config.warm_up and self._graphs_enabled and edit_drafts is None and (self.tp is None or self.tp.rank == 0):
            logger.info("warmed up the eager steps' kernels in %.1f s", warm_up(self))

    def _vision(self, config: EngineConfig, path: Path, loaded: bool) -> tuple[ImageProcessor | None,
                                                                             VideoProcessor | None,
                                                                             ImageFeatures | None]:
        """The image and video processors front ends resize with and the encoder outputs the
        runner feeds image and video tokens, for a vision-language checkpoint loaded from `path`
        (random weights for a dummy load; a tensor-parallel worker: no encoder, the features rank
        0 sends); (None, None, None) otherwise, `images_refused` then saying why a prompt's images
        and videos are refused."""
        self.images_refused = None
        if self.model_config.vision is None:
            self.images_refused = "this model reads no images (its config.json has no vision_config)"
        elif config.language_model_only:
            self.images_refused = "this engine runs the language model only (language_model_only / " \
                                   "--language-model-only): it reads no images"
        elif not loaded:
            self.images_refused = "this engine's model was given, not loaded from its checkpoint: no vision encoder"
        if self.images_refused is not None:
            return None, None, None
        hidden_size = self.model_config.hidden_size
        if self.tp is not None and self.tp.rank > 0:  # rank 0 encodes; this rank receives its features
            return None, None, ImageFeatures(None, None, None, hidden_size, self.tp)
        processor, video_processor = engine_image_processor(config), engine_video_processor(config)
        vision, quantization = self.model_config.vision, self.model_config.quantization
        if config.load_format == "dummy":  # random weights, as the language model's
            encoder = random_vision_encoder(vision, self.dtype, self.device)
        elif isinstance(quantization, Fp8Config):  # FP8 visual weights, if any, in the checkpoint's blocks
            encoder = load_vision_encoder(path, vision, self.dtype, self.device, quantization.weight_block_size)
        else:
            encoder = load_vision_encoder(path, vision, self.dtype, self.device)
        return processor, video_processor, ImageFeatures(encoder, processor, video_processor, hidden_size, self.tp)

    def _place_vision(self, token_ids: list[int], images: Seq[ImageInput],
                      videos: Seq[VideoInput]) -> tuple[list[int], PromptImages | None]:
        """The prompt with each image's token repeated to its count and each video's token
        expanded to its patches (times and tokens), and where the images and patches sit; a
        ValueError for media this engine cannot read or a prompt whose image or video tokens do
        not match them."""
        config = self.model_config
        if not images and not videos:
            for name, token in (("image", config.image_token_id), ("video", config.video_token_id)):
                if token is not None and token in token_ids:
                    raise ValueError(f"the prompt holds {name} tokens ({token}) but no {name}s were given")
            return token_ids, None
        if self.image_processor is None:
            raise ValueError(self.images_refused)
        for i, image in enumerate(images):
            if not isinstance(image, ImageInput) or image.video:
                raise ValueError(f"images[{i}] must be an image's ImageInput (ImageProcessor.resize), got "
                                 f"{type(image).__name__}{' of a video' if isinstance(image, ImageInput) else ''}")
            image.array()  # its size against its pixels
        for i, video in enumerate(videos):
            if not isinstance(video, VideoInput):
                raise ValueError(f"videos[{i}] must be a VideoInput (VideoProcessor.decode), got "
                                 f"{type(video).__name__}")
            for patch in video.patches:
                patch.array()
        expanded = expand_image_tokens(token_ids, images, config.image_token_id, self.image_processor.num_tokens)
        expanded = self.video_processor.expand(expanded, videos, self.tokenizer.encode)
        items = [*images, *(patch for video in videos for patch in video.patches)]
        grids = [(self.video_processor if item.video else self.image_processor).grid_thw(item) for item in items]
        return expanded, PromptImages.place(expanded, items, grids, config.vision.spatial_merge_size,
                                            config.image_token_id, config.video_token_id)

    # Requests -----------------------------------------------------------------------------

    def add_request(self, prompt: str | Seq[int], params: SamplingParams, request_id: str | None = None,
                    resume_from: CheckpointHandle | None = None, fork_of: str | None = None,
                    images: Seq[ImageInput] = (), videos: Seq[VideoInput] = ()) -> Request:
        """Validate and queue a request; raises ValueError and changes nothing on bad input.
        resume_from: a saved session (`save_checkpoint`); the request's tokens are the session's
        followed by the prompt (which may then be empty), and it starts from the session's
        state instead of prefilling it. fork_of: the id of a request with the same tokens (another
        choice of the prompt, n > 1); while that one is queued or running, this one waits for its
        prompt to be computed and restores it from the prefix cache instead of prefilling it.
        images: the prompt's images in order (ImageProcessor.resize), each named in the prompt
        by one image token (a chat template's placeholder) or already by all of its tokens;
        videos: its videos in order (VideoProcessor.decode), each named by one video token or
        already by its patches' times and tokens (expand_video_tokens)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params = params.resolve(self.generation_defaults)
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [t for t in ids if t >= self.model_config.vocab_size]
            if outside:
                raise ValueError(f"{name} token ids outside the vocabulary [0, {self.model_config.vocab_size}): "
                                 f"{outside[:8]}")
        if params.priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {params.priority} needs scheduling_policy 'priority' (this engine schedules "
                             f"{self.config.scheduling_policy})")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        token_ids, placed = self._place_vision(token_ids, images, videos)
        if placed is not None and resume_from is not None:
            raise ValueError("a session continues a text prompt: images and videos are not supported with resume_from")
        checkpoint = None
        if resume_from is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs the whole prompt computed: not with resume_from")
        if resume_from is not None:
            if any(t < 0 for t in resume_from.token_ids):
                raise ValueError("that session's prompt held images: it cannot be resumed")
            checkpoint = self.cache.session(resume_from)
            token_ids = list(resume_from.token_ids) + token_ids
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.model_config.vocab_size}): {bad[:8]}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids outside the vocabulary [0, {self.model_config.vocab_size}): {bad[:8]}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the context limit is {self.max_model_len} "
                             f"(including at least one generated token)")
        parent = self.requests.get(fork_of) if fork_of is not None else None
        if parent is not None and (parent.prompt_token_ids != token_ids or _digests(parent.images) != _digests(placed)
                                   or parent.params.cache_salt != params.cache_salt):
            raise ValueError(f"fork_of {fork_of!r}: that request has a different prompt or cache_salt")
        arrival = next(self._arrivals)
        request_id = str(arrival) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError(f"n = {params.n}: a request is one choice here; LLM.generate and the server's n run "
                             f"n choices of one prompt (prefilled once)")
        seed = params.seed if params.seed is not None else self.draw_seed()
        grammar = self.grammars.matcher(params.structured) if params.structured is not None else None
        request = Request.create(request_id, token_ids, params, seed, arrival, self.max_model_len, self.tokenizer)
        request.grammar = grammar
        request.images = placed
        request.fork_of = parent  # None: a finished (or unknown) parent's checkpoint is found by lookup
        self.scheduler.add(request)
        if checkpoint is not None:
            self.cache.pin(checkpoint)  # until the request restores it (or is aborted first)
            request.resume_from = checkpoint
        self.requests[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        """Abort at the next step boundary; False when the id is unknown or already finished."""
        return self._on_live(request_id, self.scheduler.abort)

    def pause(self, request_id: str) -> bool:
        """Schedule no more steps of the request until `resume` (its consumer is not reading;
        a step already launched still runs it). False when the id is unknown or finished."""
        return self._on_live(request_id, self.scheduler.pause)

    def resume(self, request_id: str) -> bool:
        return self._on_live(request_id, self.scheduler.resume)

    def _on_live(self, request_id: str, action: Callable[[Request], None]) -> bool:
        """action(request) when the id names an unfinished request; whether it did."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        action(request)
        return True

    def save_checkpoint(self, request_id: str) -> CheckpointHandle:
        """A handle on a finished request's state (prompt + output) that `add_request(...,
        resume_from=handle)` continues from without prefilling it again. The checkpoint stays
        until `release_checkpoint` (moved to the host tier, never dropped, under pressure)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} has not finished")
        return self.cache.save(request_id)

    def release_checkpoint(self, handle: CheckpointHandle) -> None:
        self.cache.release(handle)

    def clear_prefix_cache(self, reset_stats: bool = False) -> None:
        """Drop every cached checkpoint nobody pins, on the GPU and the host (between steps);
        reset_stats: and zero the cache's counters."""
        self.cache.clear(reset_stats)
        self.runner.apply_cache_ops(self.cache.take_ops())

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def reset_counters(self) -> None:
        """Speculation, preemption and step-time counters back to zero (after the warm-up, or
        before the steps a benchmark times)."""
        self.scheduler.reset_counters()
        self.step_times = _step_times()

    def reset_arrivals(self) -> None:
        """Request ids start again at "0", and unseeded requests' seeds at config.seed's first
        (after the start-up warm-up; no request may be live)."""
        assert not self.requests and not self.has_work
        self._arrivals = itertools.count()
        self._seeds = random.Random(self.config.seed)

    def draw_seed(self) -> int:
        """A seed for a request, or a prompt's choices, that set none: from config.seed's
        sequence (vLLM's engine seed), else the OS's entropy."""
        return self._seeds.getrandbits(63)

    # One step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        return self.scheduler.schedule()

    def run(self, plan: StepPlan) -> StepResult:
        return StepResult(self.runner.run(plan) if plan.rows else StepOutput([]))

    def dispatch(self) -> Dispatched:
        """The next step: the one launched ahead by the last step's wait when there is one, else
        a freshly scheduled step. Scheduling happens here; launches and the wait happen in
        `wait()`, which launches the step's continuation before waiting for it and returns it
        in the StepResult."""
        self._dispatched_at = time.perf_counter()
        current = self._in_flight
        self._back_to_back = current is not None  # launched before the step before it was read
        plan = current.plan if current is not None else self.scheduler.schedule()
        if current is None and not (self._overlap and plan.rows):
            def run(on_device: Callable[[], None] | None = None) -> StepResult:
                if on_device is not None:
                    on_device()  # it launches and waits in one call: nothing to launch first
                return self.run(plan)

            return Dispatched(plan, run)
        planned = time.perf_counter()
        follow = self._ahead = self.scheduler.continuation(plan) if self._overlap else None
        planned = time.perf_counter() - planned

        def wait(on_device: Callable[[], None] | None = None) -> StepResult:
            launched = current if current is not None else self.runner.launch(plan)
            # Its constrained rows now (the step before is committed), before the next step that
            # is fed from them is launched.
            launched.decide()
            start = time.perf_counter()
            ahead = self.runner.launch(follow) if follow is not None else None
            self._ahead_host = planned + time.perf_counter() - start
            if on_device is not None:
                on_device()
            return StepResult(launched.result(), ahead)

        return Dispatched(plan, wait)

    def commit(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Fold a step's result in; the step it launched ahead becomes the next to dispatch. A
        decode step that ran back to back with the one before reports what it cost to the
        draft policy (`_observe_cost`)."""
        start = time.perf_counter()
        self._in_flight, self._ahead = result.launched, None
        ahead = result.launched.plan if result.launched is not None else None
        # The launched step's constrained rows' masks follow this step's tokens: computed in a
        # worker from the moment the grammars have taken them, while this thread commits the
        # rest, hands out deltas and plans the step after it.
        committed = self.scheduler.commit(plan, result.output, ahead,
                                          result.launched.prefetch if result.launched is not None else None)
        deltas = []
        for request in committed + self.scheduler.take_aborted():
            deltas.append(request.take_delta())
            if request.finish_reason is not None:
                self.requests.pop(request.request_id, None)
                if request.finish_reason == "error":
                    logger.error("request %s failed: %s; serving the rest", request.request_id, NONFINITE_LOGITS)
        self.step_times.observe("admit" if plan.admits else "decode",
                                time.perf_counter() - self._dispatched_at)
        self._observe_cost(plan, start)
        return deltas

    def _observe_cost(self, plan: StepPlan, start: float) -> None:
        """Report the wall time of a step run back to back with the one before it to the draft
        policy (what it really cost, host included: spec/adaptive.py). The time from the last
        commit's start to this one's holds the last commit and the planning and launch of the
        step after this one; each of those is swapped for this step's own (its commit, ending
        now, and its planning and launch, done one step earlier). With every step alike that
        changes nothing; a lone step of another K (a probe) is priced at its own host work, not
        at its neighbours' (on the shipped model a plain probe among speculative steps read about
        40% dearer than plain steps run back to back, so the policy kept drafting). A step that
        admits (prefill chunks, cached rows) is not a decode step's price."""
        end = time.perf_counter()
        policy = self.scheduler.draft_policy
        if policy is not None and self._back_to_back and self._last_commit is not None and plan.decode_rows \
                and not plan.admits:
            seconds = (start - self._last_commit - self._last_commit_seconds - self._ahead_host
                       + self._own_host + end - start)
            policy.observe(len(plan.decode_rows), max(r.num_draft_tokens for r in plan.decode_rows), seconds)
        self._last_commit, self._last_commit_seconds = start, end - start
        self._own_host, self._ahead_host = self._ahead_host, 0.0

    def fail(self, plan: StepPlan | None) -> list[str]:
        """A step raised between dispatch and the end of its commit: its requests (the plan's
        rows not yet handed out as finished; every running request when scheduling itself
        raised, `plan` None) are finished without its tokens and their slots and blocks freed
        (Scheduler.fail). The step planned ahead of it is forgotten, and its requests (those it
        admitted too) fail with it. Returns the failed requests' ids; the rest of the engine
        goes on."""
        in_flight = self._in_flight.plan if self._in_flight is not None else None
        plans = list({id(p): p for p in (plan, in_flight, self._ahead) if p is not None}.values())
        self._in_flight = self._ahead = None
        self._last_commit = None  # the next step's wall time would include the failure
        rows = [row.request for p in plans for row in p.rows] if plan is not None else list(self.scheduler.running)
        failed = [r for r in dict.fromkeys(rows) if self.requests.get(r.request_id) is r]
        self.scheduler.fail(plans, [r for r in failed if not r.finished])
        for request in failed:
            del self.requests[request.request_id]
        return [request.request_id for request in failed]

    def step(self) -> list[RequestDelta]:
        step = self.dispatch()
        return self.commit(step.plan, step.wait())

    def stats(self) -> dict:
        running = self.scheduler.running
        return {
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_slots": self.slots.num_free,
            "num_slots": self.slots.capacity - 1,
            "num_free_kv_blocks": self.blocks.num_free,
            "num_kv_blocks": self.blocks.capacity - 1,
            "num_preempted": self.scheduler.num_preempted,
            "num_cached_slots": self.cache.num_held_slots,
            "num_cached_kv_blocks": self.cache.num_held_blocks,
            "prefix_cache": self.cache.stats_dict(),
            "state_bytes_per_sequence": self.states.bytes_per_slot,
            "state_bytes_per_sequence_without_speculation": self.states.bytes_per_slot_without_speculation,
            "num_draft_tokens": self.num_draft_tokens,
            "spec": self.scheduler.spec_stats.as_dict(),
            "step_costs": policy.costs.as_dict() if (policy := self.scheduler.draft_policy) is not None else None,
            "draft_policy": policy.snapshot() if policy is not None else None,
            "num_compiles_after_warm_up": num_compiles_after_warm_up(),
            "step_seconds": self.step_times.snapshot(),
        }

    @property
    def _graphs_enabled(self) -> bool:
        """Graphs need CUDA and kernels free of host syncs (the Triton table)."""
        return self.config.enable_cuda_graphs and self.device.type == "cuda" and self.ops.name == "triton"

    @property
    def _max_blocks_per_row(self) -> int:
        """A row's block table at most: the context plus room for k drafts' positions."""
        return -(-(self.max_model_len + self.num_draft_tokens) // self.config.block_size)

    def _decode_graphs(self, decode: DecodeStep) -> DecodeGraphs | None:
        if not self._graphs_enabled:
            return None
        graphs = DecodeGraphs(decode, self.config.max_num_seqs, self.device)
        graphs.capture()
        logger.info("captured CUDA graphs for decode batch sizes %s", graphs.buckets)
        return graphs

    def _spec_graphs(self, decode: DecodeStep, speculator: Speculator, split: bool) -> SpecGraphs | None:
        if not self._graphs_enabled:
            return None
        graphs = SpecGraphs(decode, speculator, self.config.max_num_seqs, self.num_draft_tokens, self.device, split)
        graphs.capture()
        logger.info("captured CUDA graphs for speculative steps: batch sizes %s x drafts 1..%d", graphs.buckets,
                    self.num_draft_tokens)
        return graphs

    def _prefill_graphs(self, name: str, forward: Forward, checkpoint_interval: int | None, commit: bool,
                        inputs: tuple[int, torch.dtype] | None = None) -> PrefillGraphs | None:
        """Graphs of a prefill forward where they pay (prefill_graphs.py); not under tensor
        parallelism (not yet measured with its collectives) nor with prefill graphs turned off."""
        if not (self._graphs_enabled and self.config.enable_prefill_graphs) or self.tp is not None:
            return None
        config = self.config
        graphs = PrefillGraphs(forward, config.block_size, self._max_blocks_per_row, config.max_num_batched_tokens,
                               config.max_num_seqs, checkpoint_interval, commit, self.device, inputs)
        graphs.capture()
        logger.info("captured CUDA graphs for the %s's prefill forwards: %s", name, graphs.describe())
        return graphs

    def _step_costs(self, graphs: DecodeGraphs | None, spec_graphs: SpecGraphs | None) -> StepCosts:
        """Measured on the captured graphs, else relative (eager engines)."""
        if graphs is None or spec_graphs is None:
            return StepCosts.relative(self.num_draft_tokens)
        seconds = {(bucket, 0): cost for bucket, cost in graphs.step_costs().items()}
        seconds.update(spec_graphs.step_costs())
        return StepCosts(tuple(graphs.buckets), seconds, self._sample_seconds_per_row())

    @torch.inference_mode()
    def _sample_seconds_per_row(self, num_rows: int = 256) -> float:
        """Seconds of one seeded top-p draw over the vocabulary (the sampling kernel's cost per
        row at a few hundred rows, where a sampled batch's verify positions land)."""
        logits = torch.randn(num_rows, self.model_config.vocab_size, device=self.device)
        column = lambda value, dtype: torch.full((num_rows,), value, dtype=dtype, device=self.device)  # noqa: E731
        arguments = (logits, column(0.7, torch.float32), column(0, torch.int64), column(0.95, torch.float32),
                     column(0.0, torch.float32), column(1, torch.int64), column(0, torch.int64))
        self.ops.sample(*arguments)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            self.ops.sample(*arguments)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / 3 / num_rows

    def _draft_tokens(self) -> int:
        """The most drafts a step runs: as configured, by default MAX_DRAFT_TOKENS when the
        checkpoint has MTP weights; 0 (plain decoding) without them. The log says which."""
        requested = self.config.num_draft_tokens
        if self.model.mtp is None:
            if requested:
                logger.warning("the checkpoint has no MTP weights: speculation is off (plain decoding)")
            else:
                logger.info("the checkpoint has no MTP weights: plain decoding")
            return 0
        if requested is None:
            logger.info("speculating with the checkpoint's MTP layer: up to %d drafts a step, %s", MAX_DRAFT_TOKENS,
                        "adaptive" if self.config.adaptive_draft_length else "fixed")
            return MAX_DRAFT_TOKENS
        logger.info("speculation %s", f"with up to {requested} drafts a step" if requested else "off (plain decoding)")
        return requested

    # Memory -------------------------------------------------------------------------------

    def _allocate_pools(self) -> tuple[StatePool, KVPool]:
        c, config = self.model.config, self.config  # this rank's heads under tensor parallelism
        state_dtype = torch.bfloat16 if config.mamba_ssm_cache_dtype == "bfloat16" else torch.float32
        layout = dict(max_pending=self.num_draft_tokens, dtype=self.dtype, state_dtype=state_dtype,
                      keep_mtp_hidden=bool(self.num_draft_tokens), keep_last_hidden=True)
        budget = self._memory_budget()
        self.num_checkpoint_slots = self._checkpoint_slots(StatePool(c, 1, device="meta", **layout).bytes_per_slot,
                                                           budget)
        # Slots: scratch slot 0, one per running sequence, and room for prefix-cache checkpoints.
        states = StatePool(c, config.max_num_seqs + 1 + self.num_checkpoint_slots, device=self.device, **layout)
        kv_layers = self.model.num_kv_layers
        kv_dtype = FP8_KV if config.kv_cache_dtype in FP8_KV_CACHE_DTYPES else self.dtype
        bytes_per_block = KVPool.bytes_per_block(kv_layers, config.block_size, c.num_key_value_heads, c.head_dim,
                                                 kv_dtype)
        blocks_per_sequence = self._max_blocks_per_row
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            budget -= states.num_slots * states.bytes_per_slot
            # More blocks than max_num_seqs full-length sequences can use would sit idle.
            num_blocks = min(budget // max(bytes_per_block, 1), config.max_num_seqs * blocks_per_sequence + 1)
            if num_blocks < 2:
                raise ValueError(f"not enough memory for the KV pool: budget {budget} bytes after the "
                                 f"recurrent state, {bytes_per_block} bytes per block (raise gpu_memory_utilization "
                                 f"or lower max_num_seqs)")
        kv = KVPool(kv_layers, num_blocks, config.block_size, c.num_key_value_heads, c.head_dim, kv_dtype,
                    self.device)
        logger.info("pools: %d sequence + %d checkpoint slots x %.2f MiB recurrent state with k=%d drafts (%.2f MiB "
                    "without speculation); %d KV blocks x %d tokens (%.1f MiB) = %d full-context (%d-token) "
                    "sequences at once", config.max_num_seqs, self.num_checkpoint_slots,
                    states.bytes_per_slot / 2**20, self.num_draft_tokens,
                    states.bytes_per_slot_without_speculation / 2**20, num_blocks - 1, config.block_size,
                    (num_blocks - 1) * bytes_per_block / 2**20, (num_blocks - 1) // blocks_per_sequence,
                    self.max_model_len)
        return states, kv

    def _checkpoint_slots(self, bytes_per_slot: int, budget: int) -> int:
        """Slots for prefix-cache checkpoints: as configured, or a share of the memory budget
        (at least one per running sequence, at most MAX_CHECKPOINT_SLOTS)."""
        config = self.config
        if config.num_checkpoint_slots is not None:
            return config.num_checkpoint_slots
        if not config.enable_prefix_cache:
            return 0
        share = int(CHECKPOINT_MEMORY_SHARE * budget) // max(bytes_per_slot, 1)
        return min(MAX_CHECKPOINT_SLOTS, max(config.max_num_seqs, share))

    def _memory_budget(self) -> int:
        """Bytes for the pools; under tensor parallelism the smallest rank's (every rank's
        pools have the same slots and blocks)."""
        budget = self._device_memory_budget()
        return self.tp.min_over_ranks(budget) if self.tp is not None else budget

    def _device_memory_budget(self) -> int:
        if self.device.type != "cuda":
            return self.config.cpu_memory_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        c = self.model.config
        # Activations of the largest step: a few hidden-sized and MLP-sized buffers per token,
        # plus float32 logits of every sampled row.
        width = 6 * c.hidden_size + 3 * max(c.intermediate_size, c.conv_dim + c.linear_value_dim,
                                             c.num_experts_per_tok * c.moe_intermediate_size)
        # Speculative decode rows run k + 1 tokens each (the verify logits of every one are kept
        # in the model's dtype, float32 copies of sampled rows').
        rows = self.config.max_num_seqs * (self.num_draft_tokens + 1)
        tokens = max(self.config.max_num_batched_tokens, rows)
        activations = (tokens * width * torch.finfo(self.dtype).bits // 8
                       + rows * c.vocab_size * (4 + torch.finfo(self.dtype).bits // 8) * 2)
        # vLLM's meaning of gpu_memory_utilization: this engine's share of the device, what it
        # holds already (the weights) included, so engines at 0.45 each share one device; never
        # more than is free (other processes' memory).
        allowed = int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_reserved(self.device)
        return min(allowed, free) - activations


def engine_image_processor(config: EngineConfig) -> ImageProcessor:
    """The processor of config.model (a vision-language checkpoint's directory) with the
    config's pixel bounds: the engine's, and its front ends' in another process."""
    processor = ImageProcessor.from_model_dir(Path(config.model))
    return processor.with_pixels(config.image_min_pixels, config.image_max_pixels)


def engine_video_processor(config: EngineConfig) -> VideoProcessor:
    """The video processor of config.model (a vision-language checkpoint's directory) with the
    config's options (vLLM's mm_processor_kwargs for videos)."""
    return VideoProcessor.from_model_dir(Path(config.model)).with_options(**(config.video_options or {}))


def _digests(images: PromptImages | None) -> tuple[bytes, ...]:
    return () if images is None else tuple(image.digest for image in images.images)


def _step_times() -> Durations:
    """Each step's wall time from its dispatch to the end of its commit, by kind: "admit" when it
    has new rows (prefill chunks, cached prompts), else "decode". A launched-ahead step is
    dispatched after the one before it is committed, so the spans do not overlap."""
    return Durations(STEP_BUCKETS, labels=("decode", "admit"))


def _release(workers: Workers | None, group: list, runners: list[Runner]) -> None:
    """Destroy this rank's CUDA graphs (Runner.release_graphs: an NCCL group is left only after
    them), then leave the process group: rank 0 with its workers as it stops them
    (Workers.close), a worker by itself. Not after a worker died: a collective of rank 0's may
    still wait for it on the device, and the release waits for the device (the monitor's abort
    and Workers.close's time limits handle that case)."""
    if workers is None or workers.dead is None:
        for runner in runners:
            runner.release_graphs()
    runners.clear()
    if workers is not None:
        workers.close()
    elif group[0] is not None:
        group[0].leave()
