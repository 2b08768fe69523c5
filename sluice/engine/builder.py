"""EngineConfig -> EngineParts: every part of an engine, built whole, in order.

The order is the dependencies': the target is loaded (and a speculative method's
drafter with it, which may share its tensors); the KV layout is sized from
kv_cache_memory with room for the drafter's pool; tensor-parallel ranks start and the
runners are built on that layout; then the KV connector (it moves the runner's
blocks), the scheduler (it asks the connector), the proposer, the sampler and, last,
the speculator (it times the finished runner and sampler). A failure on the way
releases what was built (worker processes, sockets, a disk tier's threads) before it
propagates, so no half-built engine exists to be shut down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice import kernels
from sluice.config import (
    EngineConfig,
    ModelConfig,
    PoolerConfig,
    resolve_dtype,
    resolve_lora_dtype,
    resolve_prompt_activations,
    resolve_quantization,
)
from sluice.core.errors import ConfigError
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.kv_connector import (
    BlockFormat,
    KVConnector,
    disk_tier,
    model_fingerprint,
    pd_decode_connector,
    pd_prefill_connector,
)
from sluice.engine.kv_sizing import plan_kv_layout
from sluice.engine.lora import LoRARegistry
from sluice.engine.prefix_cache import root_hash
from sluice.engine.scheduler import Scheduler
from sluice.engine.speculative import Speculator
from sluice.engine.speculative.methods import METHODS, build_speculator, step_cost_key
from sluice.engine.speculative.proposer import Proposer
from sluice.engine.speculative.source import DraftBuild, DraftLoad, DraftSource
from sluice.engine.tensor_parallel import TensorParallelRanks, WorkerBuild, start_tensor_parallel
from sluice.kernels import large_allocations_mapped
from sluice.loader import (
    LoadedModel,
    MemoryBudget,
    Tokenizer,
    load_model,
    resolve_chat_template,
)
from sluice.runner.encoder_runner import EncoderRunner
from sluice.runner.factory import (
    ModelVariant,
    RunnerOptions,
    build_encoder_runner,
    build_runner,
)
from sluice.runner.kv_layout import KVLayout, check_kv_cache_dtype
from sluice.runner.lora_table import LoRACapacity
from sluice.runner.model_runner import ModelRunner, check_tensor_parallel
from sluice.runner.sampler import Sampler
from sluice.structured import GrammarCompiler

logger = logging.getLogger("sluice")


@dataclass(frozen=True)
class EngineParts:
    """A finished engine's parts, as LLMEngine receives them."""

    config: EngineConfig
    model_config: ModelConfig
    model_path: Path
    tokenizer: Tokenizer
    options: RunnerOptions
    """The runners' dtype, device, weight quantization and compile flag."""
    layout: KVLayout
    """The target's KV pools (its max_model_len is the engine's context)."""
    kv: KVCacheManager
    runner: ModelRunner | EncoderRunner
    """An encoder's runner where the model is an embedding encoder."""
    scheduler: Scheduler
    sampler: Sampler
    grammars: GrammarCompiler
    speculator: Speculator | None
    kv_connector: KVConnector | None
    tensor_parallel: TensorParallelRanks | None
    startup_seconds: float
    pooler: PoolerConfig
    """How the model embeds: an encoder's pipeline, or a decoder's last token."""
    lora: LoRARegistry | None = None
    """The LoRA adapters it serves (enable_lora), lora_modules loaded."""

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV pool stores: the compute dtype's name, or "int8"."""
        if self.config.kv_cache_dtype == "auto":
            return str(self.options.dtype).removeprefix("torch.")
        return self.config.kv_cache_dtype

    @property
    def cpu_kernels(self) -> str:
        """The instruction-set level of our CPU kernels ("off" on CUDA or without them)."""
        return kernels.level_in_use() if self.options.device.type == "cpu" else "off"


@dataclass(frozen=True)
class _Target:
    """The loaded target and what was decided from it before any memory is committed."""

    loaded: LoadedModel
    options: RunnerOptions
    needs_features: bool
    drafter: DraftSource | None
    pooler: PoolerConfig
    """How the model embeds: its sentence-transformers pipeline, or a decoder's last
    token, normalized (as vLLM's pooling runner embeds with a decoder)."""
    lora: LoRARegistry | None
    """The adapters of lora_modules, loaded and checked against the model."""


@dataclass(frozen=True)
class _Serving:
    """The parts built while large allocations are mapped (the weights, the pools)."""

    layout: KVLayout
    kv: KVCacheManager
    runner: ModelRunner | EncoderRunner
    tp: TensorParallelRanks | None
    connector: KVConnector | None
    scheduler: Scheduler
    proposer: Proposer | None


def build_engine(config: EngineConfig) -> EngineParts:
    t0 = time.perf_counter()
    if config.data_parallel_size != 1:
        raise ConfigError(
            "data_parallel_size",
            "data_parallel_size > 1 is for `sluice serve` (replicas behind one server); "
            "an engine in this process is one replica",
        )
    device = config.torch_device()
    if device.type == "cpu":
        torch.set_num_threads(config.rank_threads())  # the TP ranks share the CPUs
    with contextlib.ExitStack() as undo:  # closes what was built if a later part fails
        with large_allocations_mapped():  # a load's peak memory stays near its end state
            target = _load_target(config, device)
            serving = _build_serving(config, target, undo)
        # The step-cost table is timed under the serving allocator settings.
        parts = _finish(config, target, serving, t0)
        undo.pop_all()
    # The objects of start-up (model, tokenizer, tables) live as long as the engine:
    # freezing them keeps the cyclic GC, which runs often under the allocations of a
    # step, from re-scanning them every time (it showed in decode profiles).
    gc.collect()
    gc.freeze()
    _log_ready(parts)
    return parts


def _log_ready(parts: EngineParts) -> None:
    path = parts.model_path
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    logger.info(
        "sluice ready in %.1fs: %s, %s, weights %s (%.0f MiB in memory; the file: %.0f "
        "MiB), CPU kernels %s, %d KV blocks of %d tokens (KV cache %s), max_model_len %d",
        parts.startup_seconds,
        parts.model_config.name,
        parts.options.dtype,
        parts.options.quantization,
        parts.runner.weight_bytes() / 2**20,
        sum(p.stat().st_size for p in files) / 2**20,
        parts.cpu_kernels,
        parts.layout.num_blocks,
        parts.config.block_size,
        parts.kv_cache_dtype,
        parts.layout.max_model_len,
    )


def _load_target(config: EngineConfig, device: torch.device) -> _Target:
    """Load the model (and the speculative method's drafter) and check the options
    against it, before anything is allocated."""
    # Before the model: a chat template that does not resolve fails at once.
    template = resolve_chat_template(config.chat_template) if config.chat_template else None
    loaded = load_model(config.model, config.revision, MemoryBudget.of(config))
    if template is not None:
        loaded.tokenizer.set_chat_template(template)
    mc = loaded.config
    dtype = resolve_dtype(config.dtype, device)
    quantization = resolve_quantization(
        config.quantization, device, dtype, loaded.quantized, config.dtype
    )
    check_kv_cache_dtype(config.kv_cache_dtype, config.kv_cache_skip_layers, mc)
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(mc, config.tensor_parallel_size, config.enable_expert_parallel)
    options = RunnerOptions(
        dtype,
        device,
        quantization,
        config.compile,
        config.enable_expert_parallel,
        int8_prompts=resolve_prompt_activations(config.prompt_activations, mc.hidden_size),
    )
    method = METHODS[config.speculative_method] if config.speculative_method else None
    drafter = method.load(DraftLoad(config, loaded, options)) if method else None
    needs_features = method is not None and method.needs_features
    lora = LoRARegistry.from_config(config, mc) if not mc.bidirectional else None
    return _Target(loaded, options, needs_features, drafter, _pooler(loaded), lora)


def _lora_capacity(config: EngineConfig, options: RunnerOptions) -> LoRACapacity:
    int8 = resolve_lora_dtype(config.lora_dtype, options.quantization)
    return LoRACapacity(config.max_loras, config.max_lora_rank, int8=int8)


def _pooler(loaded: LoadedModel) -> PoolerConfig:
    """What embedding requests get from this model: an encoder's (or a decoder's
    sentence-transformers folder's) pipeline, else a decoder's last token, normalized
    (a decoder's limit is its KV layout's, set by `_within_context`)."""
    mc, pooler = loaded.config, loaded.pooler
    if pooler is not None and pooler.dense and not mc.bidirectional:
        raise ConfigError("model", "dense layers after a decoder's pooling are not supported")
    if pooler is not None:
        return pooler
    limit = mc.max_position_embeddings - 1
    return PoolerConfig(mode="last", normalize=True, dimension=mc.hidden_size, max_tokens=limit)


def _build_serving(config: EngineConfig, target: _Target, undo: contextlib.ExitStack) -> _Serving:
    """The KV layout and manager, the runners (tensor-parallel ranks too), the KV
    connector, the scheduler and the proposer."""
    loaded, options, drafter = target.loaded, target.options, target.drafter
    mc = loaded.config
    if mc.bidirectional:
        return _build_encoder_serving(config, target)
    draft_bytes = drafter.kv_bytes_per_block(config.block_size, options.dtype) if drafter else 0
    layout = plan_kv_layout(config, mc, options.dtype, draft_bytes)
    kv = KVCacheManager(
        layout.num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        mc.kv_window(),
        root_hash(config.kv_cache_dtype),
        layout.local_num_blocks,
        layout.local_window,
    )
    lora = _lora_capacity(config, options) if target.lora else None
    tp = _start_tensor_parallel(config, WorkerBuild(options, layout, lora), undo)
    runner = build_runner(
        config=mc,
        tensors=loaded.tensors,  # consumed: each weight is freed once its layer holds it
        options=options,
        layout=layout,
        variant=ModelVariant(
            return_features=target.needs_features,
            pool_mode=target.pooler.mode,
            lora=lora,
        ),
        tp=tp.group if tp else None,
        followers=tp.workers if tp else None,
    )
    if tp is not None:
        tp.workers.expect("ready")
    loaded.tensors = {}
    connector = _kv_connector(config, loaded.path, options, runner)
    if connector is not None:
        undo.callback(connector.close)
    scheduler = Scheduler(
        config, kv, layout.max_model_len, connector.scheduler if connector else None
    )
    proposer = drafter.build(DraftBuild(config, mc, options, layout)) if drafter else None
    gc.collect()
    return _Serving(layout, kv, runner, tp, connector, scheduler, proposer)


# Engine options that have no meaning for an encoder (no KV cache, nothing generated).
_NOT_FOR_ENCODERS = (
    ("speculative_method", None),
    ("tensor_parallel_size", 1),
    ("kv_role", None),
    ("kv_offload_dir", None),
    ("kv_cache_dtype", "auto"),
    ("enable_lora", False),
)


def _build_encoder_serving(config: EngineConfig, target: _Target) -> _Serving:
    """An embedding encoder's parts: its runner and a scheduler that grants each input
    whole (bidirectional attention cannot compute a chunk before the rest), over a KV
    manager that only counts blocks (an encoder keeps no KV cache, so no pool)."""
    loaded, pooler = target.loaded, target.pooler
    for name, default in _NOT_FOR_ENCODERS:
        if getattr(config, name) != default:
            raise ConfigError(
                name, f"{name} does not apply to an embedding encoder ({loaded.config.name})"
            )
    max_tokens = pooler.max_tokens
    # The step's budget holds at least one input of the model's longest.
    budget = max(config.max_num_batched_tokens, max_tokens)
    step_config = dataclasses.replace(
        config, max_num_batched_tokens=budget, enable_prefix_caching=False
    )
    bs = config.block_size
    num_blocks = -(-budget // bs) + config.max_num_seqs
    layout = KVLayout(block_size=bs, num_blocks=num_blocks, max_model_len=max_tokens)
    kv = KVCacheManager(num_blocks, bs, False, None, root_hash(config.kv_cache_dtype))
    runner = build_encoder_runner(
        config=loaded.config,
        tensors=loaded.tensors,
        pooler=pooler,
        options=target.options,
    )
    scheduler = Scheduler(step_config, kv, max_tokens, whole_prompts=True)
    gc.collect()
    return _Serving(layout, kv, runner, None, None, scheduler, None)


def _finish(config: EngineConfig, target: _Target, serving: _Serving, t0: float) -> EngineParts:
    """The sampler, the grammar compiler and the speculator (which times the finished
    runner and sampler), and the parts together."""
    mc, tokenizer, options = target.loaded.config, target.loaded.tokenizer, target.options
    sampler = Sampler(mc.vocab_size, config.seed, options.device)
    speculator = None
    if serving.proposer is not None and target.drafter is not None:
        assert isinstance(serving.runner, ModelRunner), "encoders have no drafter"
        key = step_cost_key(config, target.drafter, target.loaded.path, options)
        on = (serving.runner, serving.kv, sampler)
        max_len = serving.layout.max_model_len
        speculator = build_speculator(config, serving.proposer, key, on, max_len)
    return EngineParts(
        config=config,
        model_config=mc,
        model_path=target.loaded.path,
        tokenizer=tokenizer,
        options=options,
        layout=serving.layout,
        kv=serving.kv,
        runner=serving.runner,
        scheduler=serving.scheduler,
        sampler=sampler,
        grammars=GrammarCompiler(tokenizer.backend, mc.vocab_size, tokenizer.eos_token_ids),
        speculator=speculator,
        kv_connector=serving.connector,
        tensor_parallel=serving.tp,
        startup_seconds=time.perf_counter() - t0,
        pooler=_within_context(target.pooler, serving.layout, mc),
        lora=target.lora,
    )


def _within_context(pooler: PoolerConfig, layout: KVLayout, mc: ModelConfig) -> PoolerConfig:
    """A decoder embeds inputs its KV pool can hold (one token short of its context, as
    any prompt); an encoder's limit is its own."""
    if mc.bidirectional:
        return pooler
    return dataclasses.replace(pooler, max_tokens=min(pooler.max_tokens, layout.max_model_len - 1))


def _start_tensor_parallel(
    config: EngineConfig, build: WorkerBuild, undo: contextlib.ExitStack
) -> TensorParallelRanks | None:
    """Ranks 1..N-1 (each loads the checkpoint and keeps its slice), stopped again if a
    later part fails; None without tensor parallelism."""
    if config.tensor_parallel_size == 1:
        return None
    tp = start_tensor_parallel(config, build)
    undo.callback(tp.close)
    return tp


def _kv_connector(
    config: EngineConfig, model_path: Path, options: RunnerOptions, runner: ModelRunner
) -> KVConnector | None:
    """The disk tier under the prefix cache, where kv_offload_dir asks for one, or a
    prefill or decode instance's side of a prefill/decode split (kv_role)."""
    if config.kv_role is None and config.kv_offload_dir is None:
        return None
    fmt = kv_block_format(config, model_path, options, runner)
    if config.kv_role == "decode":
        return pd_decode_connector(fmt, config.kv_transfer_timeout, runner)
    if config.kv_role == "prefill":
        host, port = config.kv_transfer_host, config.kv_transfer_port
        try:
            return pd_prefill_connector(fmt, runner, host, port, config.kv_transfer_timeout)
        except OSError as exc:
            raise ConfigError(
                "kv_transfer_port", f"cannot listen for KV transfers on {host}:{port}: {exc}"
            ) from exc
    assert config.kv_offload_dir is not None
    try:
        size = int(config.kv_offload_size * 2**30)
        return disk_tier(Path(config.kv_offload_dir), size, fmt, runner)
    except OSError as exc:
        raise ConfigError(
            "kv_offload_dir", f"kv_offload_dir {config.kv_offload_dir!r} is unusable: {exc}"
        ) from exc


def kv_block_format(
    config: EngineConfig, model_path: Path, options: RunnerOptions, runner: ModelRunner
) -> BlockFormat:
    """What one KV block's bytes mean here: a stored block is reused only where all of
    it matches."""
    dtype = str(options.dtype).removeprefix("torch.")
    return BlockFormat(
        model=model_fingerprint(model_path),
        quantization=options.quantization,
        dtype=dtype,
        kv_dtype=dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        block_size=config.block_size,
        layout=runner.kv_block_layout(),
        nbytes=runner.read_block(0).numel(),
    )
