"""LLMEngine.step(): schedule → run the model → sample → update requests → outputs."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sluice import kernels, settings
from sluice.config import (
    LOCAL_KV_GROUP,
    EngineConfig,
    ModelConfig,
    resolve_dtype,
    resolve_quantization,
)
from sluice.core.errors import ConfigError, RequestError, TensorParallelError
from sluice.core.request import DraftRow, Request, RequestStatus, SamplingRow
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.kv_connector import (
    BlockFormat,
    KVConnector,
    disk_tier,
    model_fingerprint,
    pd_decode_connector,
    pd_prefill_connector,
)
from sluice.engine.output import SequenceOutputState
from sluice.engine.prefix_cache import root_hash
from sluice.engine.scheduler import Scheduler, SchedulerOutput
from sluice.engine.speculative import Speculator
from sluice.engine.speculative.draft_load import (
    DraftModel,
    build_draft_proposer,
    load_draft_model,
)
from sluice.engine.speculative.draft_model import DraftModelProposer
from sluice.engine.speculative.eagle import EagleProposer
from sluice.engine.speculative.eagle_load import (
    EagleModel,
    build_eagle_proposer,
    load_eagle_head,
)
from sluice.engine.speculative.step_costs import StepCostMeasurement, load_or_measure
from sluice.engine.tensor_parallel import TensorParallelWorkers, WorkerBuild
from sluice.kernels import large_allocations_mapped
from sluice.loader import LoadedModel, load_model, resolve_chat_template
from sluice.outputs import CompletionOutput, Logprob, RequestMetricsOut, RequestOutput
from sluice.parallel import TPGroup, join_group, make_spec, remove_spec_files
from sluice.runner.model_runner import (
    ModelOutput,
    ModelRunner,
    check_kv_cache_dtype,
    check_tensor_parallel,
    kv_bytes_per_block,
)
from sluice.runner.sampler import Sampler
from sluice.runner.spec_verify import accepted_length
from sluice.sampling_params import SamplingParams
from sluice.structured import ConstraintMasks, GrammarCompiler, advance, forced_tokens

logger = logging.getLogger("sluice")


def _file_identity(path: str) -> str:
    """A file's path, size and modification time (a retrained head is another key)."""
    st = Path(path).stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _file_bytes(path: Path) -> int:
    """The model's size on disk (a file, or an HF directory's files)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _num_kv_blocks(config: EngineConfig, per_block: int) -> int:
    """How many blocks of `per_block` bytes (the K and V of every layer; a draft
    model's too) kv_cache_memory holds."""
    num_blocks = int(config.kv_cache_memory * 2**30) // per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory} GiB holds fewer than 2 blocks "
            f"of {config.block_size} tokens ({per_block} bytes each)"
        )
    return num_blocks


def _split_kv_blocks(
    config: EngineConfig,
    mc: ModelConfig,
    dtype: torch.dtype,
    extra_global_bytes: int,
    local: list[int],
    window: int,
) -> tuple[int, int]:
    """(global blocks, local blocks) of a split KV cache out of kv_cache_memory.

    The bytes are shared in proportion to what one sequence at max_model_len holds in
    each group: every position in the full-attention layers (plus `extra_global_bytes`
    a block, a draft model's pool, which mirrors the global table), at most a window
    plus a prefill chunk in the windowed ones. The local pool never holds fewer blocks
    than one sequence needs at once: a window plus a chunk, one block more for the
    window's unaligned start and one for a copy-on-write."""
    bs = config.block_size
    full = [i for i in range(mc.num_layers) if i not in set(local)]
    kv_dtype, skip = config.kv_cache_dtype, config.kv_cache_skip_layers
    per_global = kv_bytes_per_block(mc, bs, dtype, kv_dtype, skip, full) + extra_global_bytes
    per_local = kv_bytes_per_block(mc, bs, dtype, kv_dtype, skip, local)
    reach = window + config.max_num_batched_tokens
    length = config.max_model_len or mc.max_position_embeddings
    global_share = per_global * -(-length // bs)
    local_share = per_local * -(-min(length, reach) // bs)
    total = int(config.kv_cache_memory * 2**30)
    by_share = total * local_share // (global_share + local_share) // per_local
    num_local = max(by_share, -(-reach // bs) + 2)
    num_global = (total - num_local * per_local) // per_global
    if num_global < 2:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory} GiB holds fewer than 2 blocks of "
            f"{bs} tokens for the full-attention layers beside the {num_local} blocks the "
            f"windowed layers need ({per_global} and {per_local} bytes each)"
        )
    return num_global, num_local


@dataclass
class _Group:
    """The user's request: one prompt and its n output sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    sent_tokens: list[int] = field(default_factory=list)


@dataclass
class _WasteCounter:
    allocated_slots: int = 0
    used_slots: int = 0

    @property
    def fraction(self) -> float:
        return 1.0 - self.used_slots / self.allocated_slots if self.allocated_slots else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        if config.data_parallel_size != 1:
            raise ConfigError(
                "data_parallel_size",
                "data_parallel_size > 1 is for `sluice serve` (replicas behind one server); "
                "an engine in this process is one replica",
            )
        self.config = config
        device = config.torch_device()
        if device.type == "cpu":
            torch.set_num_threads(config.rank_threads())  # the TP ranks share the CPUs
        with large_allocations_mapped():  # a load's peak memory stays near its end state
            mc, num_blocks = self._load(config, device)
        self.sampler = Sampler(mc.vocab_size, config.seed, device)
        self.grammars = GrammarCompiler(
            self.tokenizer.backend, mc.vocab_size, self.tokenizer.eos_token_ids
        )
        self.constraint_masks = ConstraintMasks(mc.vocab_size)
        self.num_forced_tokens = 0
        # The instruction-set level of our CPU kernels ("off" on CUDA or without them).
        self.cpu_kernels = kernels.variant() if device.type == "cpu" else "off"
        self.speculator = self._make_speculator(config, device)
        self.groups: dict[str, _Group] = {}
        self._seqs: dict[str, Request] = {}
        self.waste = _WasteCounter()
        self.num_steps = 0
        self.num_generated_tokens = 0
        # The objects of start-up (model, tokenizer, tables) live as long as the engine:
        # freezing them keeps the cyclic GC, which runs often under the allocations of a
        # step, from re-scanning them every time (it showed in decode profiles).
        gc.collect()
        gc.freeze()
        self.startup_seconds = time.perf_counter() - t0
        self.weight_bytes = self.runner.weight_bytes()
        logger.info(
            "sluice ready in %.1fs: %s, %s, weights %s (%.0f MiB in memory; the file: %.0f "
            "MiB), CPU kernels %s, %d KV blocks of %d tokens (KV cache %s), max_model_len %d",
            self.startup_seconds,
            mc.name,
            self.dtype,
            self.quantization,
            self.weight_bytes / 2**20,
            _file_bytes(self.model_path) / 2**20,
            self.cpu_kernels,
            num_blocks,
            config.block_size,
            self.kv_cache_dtype,
            self.max_model_len,
        )

    def _make_speculator(self, config: EngineConfig, device: torch.device) -> Speculator | None:
        """The speculator, with the step-cost table of this model on this machine
        (measured once, then read from the cache)."""
        if config.speculative_method is None:
            return None
        path = Path(self.model_path)
        key = {
            "model": str(path.resolve()),
            "size": path.stat().st_size if path.is_file() else 0,
            "draft_model": (
                _file_identity(self.draft.head_path)
                if isinstance(self.draft, EagleProposer)
                else config.speculative_model
            ),
            "draft_vocab": config.speculative_draft_vocab_size,
            "dtype": str(self.dtype),
            "quantization": self.quantization,
            "kernels": kernels.build_id() if device.type == "cpu" else "off",
            "threads": torch.get_num_threads() if device.type == "cpu" else 0,
            "device": str(device),
            "block_size": config.block_size,
            "max_drafts": config.num_speculative_tokens,
        }
        draft = (self.draft.runner, self.draft.kv) if self.draft else None
        measurement = StepCostMeasurement(
            self.runner, self.kv, self.sampler, config.num_speculative_tokens, draft
        )
        costs = load_or_measure(key, measurement)
        return Speculator(
            config.speculative_method,
            config.num_speculative_tokens,
            self.max_model_len,
            costs,
            proposer=self.draft,
        )

    def _load(self, config: EngineConfig, device: torch.device) -> tuple[ModelConfig, int]:
        """Load the model, size the KV pool and build the scheduler and the runner;
        (the model's config, the number of KV blocks)."""
        # Before the model: a chat template that does not resolve fails at once.
        template = resolve_chat_template(config.chat_template) if config.chat_template else None
        loaded = load_model(config.model)
        self.model_path = loaded.path
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        if template is not None:
            self.tokenizer.set_chat_template(template)
        self.dtype = resolve_dtype(config.dtype, device)
        self.quantization = resolve_quantization(
            config.quantization, device, self.dtype, loaded.quantized, config.dtype
        )
        check_kv_cache_dtype(config.kv_cache_dtype, config.kv_cache_skip_layers, mc)
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(mc, config.tensor_parallel_size)
        # What the pool stores: the compute dtype's name, or "int8".
        self.kv_cache_dtype = (
            str(self.dtype).removeprefix("torch.")
            if config.kv_cache_dtype == "auto"
            else config.kv_cache_dtype
        )
        per_block = kv_bytes_per_block(
            mc, config.block_size, self.dtype, config.kv_cache_dtype, config.kv_cache_skip_layers
        )
        # A draft model is loaded (and checked against the tokenizer) before anything is
        # built; its KV pool gets as many blocks as the target's, from the same memory.
        draft: DraftModel | None = None
        draft_bytes = 0
        eagle: EagleModel | None = None
        if config.speculative_method == "draft":
            draft = load_draft_model(config, loaded, self.dtype, device)
            draft_bytes = draft.kv_bytes_per_block(config.block_size, self.dtype)
        elif config.speculative_method == "eagle":
            eagle = load_eagle_head(config, loaded, self.quantization)
            draft_bytes = eagle.kv_bytes_per_block(config.block_size, self.dtype)
        local_layers = self._split_kv_local_layers(config, mc)
        local_num_blocks: int | None = None
        # The windowed layers' largest window: what the local pool keeps of a sequence.
        local_window = max((mc.layer_window(i) or 0) for i in local_layers) if local_layers else 0
        if local_layers:
            num_blocks, local_num_blocks = _split_kv_blocks(
                config, mc, self.dtype, draft_bytes, local_layers, local_window
            )
        else:
            num_blocks = _num_kv_blocks(config, per_block + draft_bytes)
        # Only the global pool caps a sequence's length: the local one needs a window.
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, num_blocks * config.block_size
        )
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            mc.kv_window(),
            root_hash(config.kv_cache_dtype),
            local_num_blocks,
            local_window or None,
        )
        if local_num_blocks is not None:
            logger.info(
                "split KV cache: %d blocks for the %d full-attention layers, %d for the %d "
                "windowed layers",
                num_blocks,
                mc.num_layers - len(local_layers),
                local_num_blocks,
                len(local_layers),
            )
        self.runner = self._build_runner(config, loaded, device, num_blocks, local_num_blocks)
        del loaded
        self.kv_connector = self._make_kv_connector(config)
        self.scheduler = Scheduler(
            config,
            self.kv,
            self.max_model_len,
            self.kv_connector.scheduler if self.kv_connector else None,
        )
        self.draft: DraftModelProposer | EagleProposer | None = None
        if draft is not None:
            self.draft = build_draft_proposer(
                draft, config, mc, self.dtype, device, num_blocks, self.max_model_len
            )
        elif eagle is not None:
            self.draft = build_eagle_proposer(
                eagle,
                config,
                self.dtype,
                device,
                self.quantization,
                num_blocks,
                self.max_model_len,
            )
        gc.collect()
        return mc, num_blocks

    @staticmethod
    def _split_kv_local_layers(config: EngineConfig, mc: ModelConfig) -> list[int]:
        """The windowed layers a split KV cache keeps in a pool of their own, or [] for
        one pool: where every layer or none is windowed, where split_kv_pool=False asks
        for one, and under a KV connector (kv_offload_dir, kv_role), whose blocks are
        one pool's (a block id, a file of every layer's K/V)."""
        local = mc.split_kv_local_layers()
        if not local or not config.split_kv_pool:
            return []
        if config.kv_offload_dir is not None or config.kv_role is not None:
            logger.info(
                "one KV pool for every layer: kv_offload_dir and kv_role move whole blocks "
                "of one pool (the windowed layers' K/V are kept for the whole sequence)"
            )
            return []
        return local

    def _build_runner(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        device: torch.device,
        num_blocks: int,
        local_num_blocks: int | None = None,
    ) -> ModelRunner:
        """This process's runner: the whole model, or rank 0 of a tensor-parallel group
        whose other ranks it starts (and stops again if the start fails)."""
        build = WorkerBuild(self.dtype, self.quantization, num_blocks, self.max_model_len)
        self.tp_workers: TensorParallelWorkers | None = None
        self.tp_group = self._start_tensor_parallel(config, device, build)
        try:
            runner = ModelRunner(
                loaded.config,
                loaded.tensors,  # consumed: each weight is freed once its layer holds it
                self.dtype,
                device,
                config.block_size,
                num_blocks,
                self.max_model_len,
                self.quantization,
                config.compile,
                config.kv_cache_dtype,
                config.kv_cache_skip_layers,
                tp=self.tp_group,
                local_num_blocks=local_num_blocks,
                # An EAGLE head drafts from the target's hidden states.
                return_features=config.speculative_method == "eagle",
            )
            if self.tp_workers is not None:
                self.tp_workers.expect("ready")
                runner.followers = self.tp_workers
        except BaseException:
            self.shutdown()
            raise
        return runner

    def _start_tensor_parallel(
        self, config: EngineConfig, device: torch.device, build: WorkerBuild
    ) -> TPGroup | None:
        """Start ranks 1..N-1 (each loads the checkpoint and keeps its slice) and join
        their group as rank 0; None without tensor parallelism. KV blocks: every rank
        has `num_blocks`, of its own heads, so kv_cache_memory is the group's total."""
        if config.tensor_parallel_size == 1:
            return None
        if torch.distributed.is_initialized():
            raise TensorParallelError(
                "this process already runs a tensor-parallel group (one per process): "
                "shut the other engine down first (LLM.shutdown())"
            )
        spec = make_spec(config.tensor_parallel_size, device, settings.tp_allreduce())
        workers = TensorParallelWorkers(config, spec)
        try:
            workers.expect("loaded")
            workers.build(build)
            group = join_group(spec, 0, workers.alive)
        except BaseException:
            workers.close(timeout_s=2.0)
            remove_spec_files(spec)
            raise
        self.tp_workers = workers
        logger.info(
            "tensor parallel: %d ranks, all-reduce over %s, %d torch threads each",
            spec.world_size,
            spec.allreduce,
            config.rank_threads(),
        )
        return group

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (and finish the KV connector's saves); the
        engine cannot step after this."""
        if getattr(self, "kv_connector", None) is not None:
            self.close()
        if self.tp_workers is not None:
            self.tp_workers.close()
            self.tp_workers = None
        if self.tp_group is not None:
            self.tp_group.close()
            self.tp_group = None

    def _make_kv_connector(self, config: EngineConfig) -> KVConnector | None:
        """The disk tier under the prefix cache, where kv_offload_dir asks for one, or
        a prefill or decode instance's side of a prefill/decode split (kv_role)."""
        if config.kv_role is not None:
            return self._make_pd_connector(config)
        if config.kv_offload_dir is None:
            return None
        try:
            return disk_tier(
                Path(config.kv_offload_dir),
                int(config.kv_offload_size * 2**30),
                self.kv_block_format(),
                self.runner,
            )
        except OSError as exc:
            raise ConfigError(
                "kv_offload_dir", f"kv_offload_dir {config.kv_offload_dir!r} is unusable: {exc}"
            ) from exc

    def _make_pd_connector(self, config: EngineConfig) -> KVConnector:
        fmt = self.kv_block_format()
        if config.kv_role == "decode":
            return pd_decode_connector(fmt, config.kv_transfer_timeout, self.runner)
        try:
            return pd_prefill_connector(
                fmt,
                self.runner,
                config.kv_transfer_host,
                config.kv_transfer_port,
                config.kv_transfer_timeout,
            )
        except OSError as exc:
            raise ConfigError(
                "kv_transfer_port",
                f"cannot listen for KV transfers on {config.kv_transfer_host}:"
                f"{config.kv_transfer_port}: {exc}",
            ) from exc

    def kv_block_format(self) -> BlockFormat:
        """What one KV block's bytes mean here: a stored block is reused only where all
        of it matches."""
        dtype = str(self.dtype).removeprefix("torch.")
        # The KV cache's own dtype where the config has one (a quantized KV cache).
        kv_dtype = getattr(self.config, "kv_cache_dtype", None)
        return BlockFormat(
            model=model_fingerprint(Path(self.model_path)),
            quantization=self.quantization,
            dtype=dtype,
            kv_dtype=dtype if kv_dtype in (None, "auto") else str(kv_dtype),
            block_size=self.config.block_size,
            layout=self.runner.kv_block_layout(),
            nbytes=self.runner.read_block(0).numel(),
        )

    # ---- requests in ----------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "prompt must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise RequestError("prompt", "prompt must be a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(
                "prompt", f"token id {bad[0]} is out of range [0, {self.model_config.vocab_size})"
            )
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params", "sampling_params must be a SamplingParams")
        if request_id in self.groups:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.model_config.vocab_size]
            if bad:
                raise RequestError(
                    "logit_bias",
                    f"logit_bias token id {bad[0]} is out of range "
                    f"[0, {self.model_config.vocab_size})",
                )
        ids = self.encode_prompt(prompt)
        if not ids:
            raise RequestError("prompt", "prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                "prompt",
                f"the prompt has {len(ids)} tokens but this model's context is "
                f"{self.max_model_len} tokens (prompt and output together)",
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        constraint = params.structured_output
        # Compiled (or found in the cache) before anything is queued: a bad grammar is
        # this request's error, never the engine's.
        grammar = self.grammars.compile(constraint) if constraint is not None else None
        seqs = []
        for i in range(params.n):
            seq = Request(
                request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                prompt_token_ids=ids,
                sampling_params=params,
                group_id=request_id,
                index=i,
                priority=priority,
                arrival_time=arrival,
                # n > 1 with a seed: sample i uses seed + i, so it equals a separate
                # request seeded that way.
                seed=None if params.seed is None else params.seed + i,
            )
            seq.output = SequenceOutputState(self.tokenizer, ids, params)
            if grammar is not None:
                seq.grammar = grammar.deep_copy()
            if params.logprobs is not None:
                seq.logprobs = []
            seqs.append(seq)
            self._seqs[seq.request_id] = seq
        # The first sequence computes the prompt; the others fork from it (sharing its
        # blocks, copy-on-write) when its first token is sampled.
        seqs[0].pending_forks = seqs[1:]
        self.groups[request_id] = _Group(
            request_id, prompt if isinstance(prompt, str) else None, ids, seqs, [0] * params.n
        )
        self.scheduler.add(seqs[0])

    def abort_request(self, request_id: str) -> bool:
        """Abort a request and free its blocks. Returns False if it was not known."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            if not seq.is_finished:
                self._retire(seq, RequestStatus.FINISHED_ABORTED)
            self._seqs.pop(seq.request_id, None)
        self._save_kv()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- one step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self._release_drafts(sched.preempted)
        if not sched:
            if self.kv_connector is not None and self.scheduler.waiting:
                # Requests wait for KV on its way (a decode instance's pulls): sleep
                # until some arrives rather than spin against the threads moving it.
                self.kv_connector.scheduler.wait_for_arrivals(0.01)
            return []
        try:
            outputs = self._run_step(sched)
        except BaseException:
            self._undo_step(sched)
            raise
        # Only now is this step's KV known to be written (on CUDA the kernels run
        # asynchronously, and a failure surfaces at the first sync, in sampling).
        self.kv.commit_names()
        self._save_kv()
        return outputs

    def _save_kv(self) -> None:
        """Hand the blocks of requests that just finished to the KV connector, before
        anything can write the pool again (their blocks are free now)."""
        if self.kv_connector is not None:
            self.kv_connector.worker.save(self.kv_connector.scheduler.take_saves())

    def wait_for_kv_saves(self) -> None:
        """Block until the KV connector has stored every block handed to it."""
        if self.kv_connector is not None:
            self.kv_connector.worker.wait_for_saves()

    def close(self) -> None:
        """Finish the KV connector's saves in flight; the engine goes on without it."""
        self.attach_kv_connector(None)

    def attach_kv_connector(self, connector: KVConnector | None) -> None:
        """Replace the KV connector (the old one finishes its saves first), e.g. a disk
        tier on another directory; None: none. Call between steps."""
        if connector is not None and self.kv.local_pool is not None:
            # A connector's block bytes are one pool's; the split cache has two.
            raise ValueError(
                "connector: KV connectors need a single KV pool; this engine splits its "
                "pool for the windowed layers (construct it with split_kv_pool=False)"
            )
        if self.kv_connector is not None:
            self._save_kv()
            self.kv_connector.close()
        self.kv_connector = connector
        self.scheduler.connector = connector.scheduler if connector else None

    def _undo_step(self, sched: SchedulerOutput) -> None:
        """A step raised: it may have written all, some or none of its KV. The blocks it
        named leave the prefix cache, and the requests it scheduled go back to be
        recomputed, so nothing reads what it left. The caller may abort them or step again."""
        self.kv.forget_uncommitted_names()
        if self.kv_connector is not None:
            self.kv_connector.step_failed()
        self.scheduler.requeue([req for req, _ in sched.scheduled])
        self._release_drafts([req for req, _ in sched.scheduled])

    def _run_step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        if sched.kv_loads:
            assert self.kv_connector is not None
            self.kv_connector.worker.load(sched.kv_loads)
        self.runner.copy_blocks(sched.blocks_to_copy)
        self.runner.copy_blocks(sched.local_blocks_to_copy, LOCAL_KV_GROUP)
        result = self.runner.execute(sched.scheduled)
        if self.speculator is not None and isinstance(self.draft, EagleProposer):
            assert result.features is not None
            self.draft.take_features(sched.scheduled, result.features)
        for req, n in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            req.num_computed_tokens += n
        self._track_waste()
        for req_id, (start, logits) in result.prompt_logits.items():
            self._add_prompt_logprobs(self._seqs[req_id], start, logits)

        seqs, rows, logits = self._sampling_rows(result)
        stop_ids = [self._stop_token_ids(r.sampling_params) for r in rows]
        sampled = self.sampler(logits, rows, stop_ids, self.constraint_masks(rows))

        finished_at = time.monotonic()
        touched: dict[str, _Group] = {}
        num_emitted = 0
        for req, first, count in seqs:
            if req.pending_forks:
                for child in req.pending_forks:
                    self.kv.fork(req, child)
                    self.scheduler.add_running(child)
                req.pending_forks = []
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = finished_at
            tokens = sampled.token_ids[first : first + count]
            drafts = req.spec_token_ids
            accepted = accepted_length(tokens, drafts) if drafts else 0
            logprobs = sampled.logprobs[first : first + accepted + 1]
            emitted = self._emit(req, tokens[: accepted + 1], logprobs, finished_at)
            num_emitted += emitted
            if drafts:
                self._end_verification(req, len(drafts), accepted, emitted)
            touched[req.group_id] = self.groups[req.group_id]
        self.num_steps += 1
        self.num_generated_tokens += num_emitted
        return [self._make_output(g) for g in touched.values()]

    def _sampling_rows(
        self, result: ModelOutput
    ) -> tuple[list[tuple[Request, int, int]], list[SamplingRow], torch.Tensor]:
        """The sampler's rows: for each request that samples, and each fork waiting on
        it (sampling from the same logits), its own row and one row per draft token it
        verifies. Also (request, its first row, its number of rows) and the logits in
        row order."""
        seqs: list[tuple[Request, int, int]] = []
        rows: list[SamplingRow] = []
        src: list[int] = []
        first = 0
        for req, count in zip(result.sampling_requests, result.num_rows, strict=True):
            for r in (req, *req.pending_forks):
                seqs.append((r, len(rows), count))
                rows.append(r)
                rows.extend(DraftRow(r, r.spec_token_ids[:j]) for j in range(1, count))
                src.extend(range(first, first + count))
            first += count
        logits = result.logits
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(src, device=logits.device)]
        return seqs, rows, logits

    def _emit(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[tuple[float, int, list[int], list[float]] | None],
        now: float,
    ) -> int:
        """Append sampled tokens in order until one finishes the sequence, then any
        tokens its grammar forces; how many sampled tokens went in."""
        for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            if lp is not None and req.logprobs is not None:
                self._add_logprobs(req, tok, lp)
            if self._append(req, tok, now):
                return i + 1
        # Tokens the grammar forces go in without a step each: the scheduler computes
        # them next step as one short chunk.
        forced = forced_tokens(req)
        for i, tok_f in enumerate(forced):
            self.num_forced_tokens += 1
            # The matcher has all of them already: it is complete, if at all, only
            # after the last.
            last = i == len(forced) - 1
            if self._append(req, tok_f, now, consumed=True, last=last):
                break
        return len(tokens)

    def _end_verification(
        self, req: Request, num_drafts: int, num_accepted: int, num_emitted: int
    ) -> None:
        """After a request verified its drafts: the speculator and the request's metrics
        learn how many were accepted, and the KV of the rejected ones is rolled back (a
        finished request has freed its blocks already)."""
        assert self.speculator is not None
        self.speculator.observe(req, num_drafts, num_accepted, num_emitted)
        req.metrics.spec_drafted_tokens += num_drafts
        req.metrics.spec_accepted_tokens += num_accepted
        req.spec_token_ids = []
        if not req.is_finished:
            self.kv.rollback(req, num_drafts - num_accepted)

    def _append(
        self, req: Request, tok: int, now: float, consumed: bool = False, last: bool = True
    ) -> bool:
        """Add one output token and apply the stop rules (and the grammar's end); True
        if the sequence finished. consumed: the grammar's matcher has the token already
        (a forced token; last: the last of them)."""
        req.append_token(tok)
        assert req.output is not None
        params = req.sampling_params
        max_tokens = min(
            params.max_tokens if params.max_tokens is not None else self.max_model_len,
            self.max_model_len - req.num_prompt_tokens,
        )
        complete = advance(req, tok, consumed) and last
        if not (req.output.append(tok, max_tokens) or (complete and req.output.finish_complete())):
            return False
        status = (
            RequestStatus.FINISHED_LENGTH
            if req.output.finish_reason == "length"
            else RequestStatus.FINISHED_STOPPED
        )
        req.metrics.finished_time = now
        self._retire(req, status)
        return True

    def _retire(self, req: Request, status: RequestStatus) -> None:
        """The one way a sequence ends (finished or aborted): the scheduler frees it,
        and the speculator hears of it (the suffix proposer keeps its tokens)."""
        self.scheduler.finish(req, status)
        if self.speculator is not None:
            self.speculator.finish(req)

    # ---- helpers -------------------------------------------------------------------

    def _release_drafts(self, requests: list[Request]) -> None:
        """Requests whose KV was dropped to be recomputed (preempted, requeued) drop
        their proposer state too: a draft model's blocks go back to its pool."""
        if self.speculator is not None:
            for req in requests:
                self.speculator.release(req)

    def _stop_token_ids(self, p: SamplingParams) -> list[int]:
        ids = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            ids.extend(self.tokenizer.eos_token_ids)
        return ids

    def _track_waste(self) -> None:
        for req in self.scheduler.running:
            held, used = self.kv.slot_usage(req)  # blocks a window released are neither
            self.waste.allocated_slots += held
            self.waste.used_slots += used

    def _add_logprobs(
        self, req: Request, tok: int, lp: tuple[float, int, list[int], list[float]]
    ) -> None:
        value, rank, top_ids, top_vals = lp
        entry = {tok: Logprob(value, rank, self.tokenizer.decode([tok], skip_special_tokens=False))}
        for i, (tid, tv) in enumerate(zip(top_ids, top_vals, strict=True)):
            if tid not in entry:
                entry[tid] = Logprob(
                    tv, i + 1, self.tokenizer.decode([tid], skip_special_tokens=False)
                )
        assert req.logprobs is not None
        req.logprobs.append(entry)
        req.cumulative_logprob += value

    def _add_prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        """Logits at positions start.. predict prompt tokens start+1..; position 0 has none."""
        n_top = req.sampling_params.prompt_logprobs or 0
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        # After a preemption the prompt is recomputed: skip positions already recorded.
        skip = len(req.prompt_logprobs) - 1 - start
        prompt = req.prompt_token_ids
        count = min(logits.shape[0], len(prompt) - 1 - start)
        if count <= skip:
            return
        logprobs = torch.log_softmax(logits[skip:count], dim=-1)
        start, count = start + skip, count - skip
        targets = torch.tensor(prompt[start + 1 : start + 1 + count])
        chosen = logprobs[torch.arange(count), targets]
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        top_vals, top_ids = logprobs.topk(n_top) if n_top else (None, None)
        for j in range(count):
            t = int(targets[j])
            entry = {t: Logprob(float(chosen[j]), int(ranks[j]))}
            if top_ids is not None and top_vals is not None:
                for r, (tid, tv) in enumerate(
                    zip(top_ids[j].tolist(), top_vals[j].tolist(), strict=True)
                ):
                    entry.setdefault(tid, Logprob(tv, r + 1))
            req.prompt_logprobs.append(entry)

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, seq in enumerate(group.seqs):
            st = seq.output
            assert st is not None
            new_ids = st.token_ids[group.sent_tokens[i] :]
            group.sent_tokens[i] = len(st.token_ids)
            reason = st.finish_reason if seq.is_finished else None
            outs.append(
                CompletionOutput(
                    index=i,
                    text=st.text,
                    token_ids=list(st.token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    # A copy: the engine keeps appending to its own list (another thread
                    # may be reading this output).
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=reason,
                    stop_reason=st.stop_reason,
                    delta_text=st.take_delta(),
                    delta_token_ids=new_ids,
                )
            )
        leader = group.seqs[0]
        finished = all(s.is_finished for s in group.seqs)
        m = leader.metrics
        out = RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=max(leader.num_cached_tokens, 0),
            prompt_logprobs=leader.prompt_logprobs,
            metrics=RequestMetricsOut(
                m.arrival_time,
                m.first_scheduled_time,
                m.first_token_time,
                max((s.metrics.finished_time or 0.0) for s in group.seqs) if finished else None,
                spec_drafted_tokens=sum(s.metrics.spec_drafted_tokens for s in group.seqs),
                spec_accepted_tokens=sum(s.metrics.spec_accepted_tokens for s in group.seqs),
            ),
        )
        if finished:
            if self.kv_connector is not None:
                out.kv_transfer_params = self.kv_connector.scheduler.take_transfer_params(
                    leader.request_id
                )
            del self.groups[group.request_id]
            for s in group.seqs:
                self._seqs.pop(s.request_id, None)
        return out

    # ---- introspection ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """/stats' JSON: EngineStats as a dict. Each stat's meaning, merge across
        replicas and Prometheus export are declared on its field (sluice/engine/stats.py,
        which imports nothing of the engine)."""
        from sluice.engine.stats import EngineStats, ratio

        pool, local = self.kv.pool, self.kv.local_pool
        spec, draft = self.speculator, self.draft
        drafted = spec.num_drafted_tokens if spec else 0
        accepted = spec.num_accepted_tokens if spec else 0
        emitted = spec.num_emitted_tokens if spec else 0
        steps = spec.num_verify_steps if spec else 0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_requests=len(self.groups),
            kv_total_blocks=pool.num_blocks,
            kv_free_blocks=pool.num_free,
            kv_local_total_blocks=local.num_blocks if local else 0,
            kv_local_free_blocks=local.num_free if local else 0,
            kv_usage=self.kv.usage,
            kv_waste=self.waste.fraction,
            prefix_cache_hit_rate=self.kv.prefix_cache_hit_rate,
            prefix_cache_queried_tokens=self.kv.num_queried_tokens,
            prefix_cache_hit_tokens=self.kv.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_forced_tokens=self.num_forced_tokens,
            spec_method=self.config.speculative_method,
            spec_drafted_tokens=drafted,
            spec_accepted_tokens=accepted,
            spec_emitted_tokens=emitted,
            spec_verify_steps=steps,
            spec_acceptance_rate=ratio(accepted, drafted),
            spec_mean_accepted_length=ratio(emitted, steps),
            spec_draft_kv_total_blocks=draft.kv.pool.num_blocks if draft else 0,
            spec_draft_kv_free_blocks=draft.kv.num_free_blocks if draft else 0,
            spec_draft_forwards=draft.num_forwards if draft else 0,
            connector=self.kv_connector.stats() if self.kv_connector else None,
            grammars_compiled=self.grammars.num_compiled,
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            cpu_kernels=self.cpu_kernels,
            weight_bytes=self.weight_bytes,
        ).as_dict()

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()
