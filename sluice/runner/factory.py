"""Every ModelRunner is built here: the target, a tensor-parallel rank, a draft model, an
EAGLE head. They differ only in a ModelVariant and in the tensor-parallel group; what
the engine's options decide (dtype, device, weight quantization, compile, the KV
layout) reaches all of them the same way, so an option cannot reach some of them and
silently miss the others."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from sluice.architectures import spec_of
from sluice.attention import kv_int8, select_backend
from sluice.config import ModelConfig, PoolerConfig
from sluice.core.choices import PoolingMode, WeightQuantization
from sluice.core.errors import ConfigError
from sluice.core.quantized_tensor import Weight
from sluice.layers.linear import Linear
from sluice.layers.quantization import make_linear_method
from sluice.models import encoder_class, model_class
from sluice.models.encoder import BidirectionalDecoder
from sluice.models.llama import LlamaForCausalLM
from sluice.models.llama_decode_stack import LlamaDecodeStack
from sluice.models.pooler import Pooler
from sluice.models.tp_shard import Collectives, local_config, shard_checkpoint
from sluice.runner.encoder_runner import EncoderRunner
from sluice.runner.kv_layout import KVLayout, allocate_kv_pools
from sluice.runner.lora_table import LoRACapacity, LoRASlotTable
from sluice.runner.model_runner import ModelRunner, StepFollowers, check_tensor_parallel

logger = logging.getLogger("sluice")


@dataclass(frozen=True)
class RunnerOptions:
    """What the engine's options decide for every runner it builds."""

    dtype: torch.dtype
    """Compute dtype of weights and activations (and of a full-precision KV cache)."""
    device: torch.device
    """Where the weights, the KV pools and the step tensors live."""
    quantization: WeightQuantization = "none"
    """The method every Linear gets ("gguf": a GGUF's blocks as stored; CPU only)."""
    compile: bool = False
    """torch.compile the model (dynamic in the number of tokens)."""
    expert_parallel: bool = False
    """Tensor-parallel ranks split a Mixture-of-Experts model's experts, whole experts each."""
    int8_prompts: bool = False
    """Many-row matmuls on quantized weights take int8 activations (the int8 GEMM)."""


@dataclass(frozen=True)
class ModelVariant:
    """Which module a runner runs and what it returns beside the sampling logits."""

    model_type: type[LlamaForCausalLM] | None = None
    """The module class; None: the one registered for the config's architecture."""
    output_ids: torch.Tensor | None = None
    """Logits for these vocabulary ids only (a draft's restricted output head)."""
    return_features: bool = False
    """Each step also returns every token's final-normed hidden state."""
    pool_mode: PoolingMode = "last"
    """How embedding requests pool their prompt's final-normed hidden states."""
    lora: LoRACapacity | None = None
    """Slots for LoRA adapters beside every adaptable layer (the target, with LoRA on)."""


TARGET = ModelVariant()


def build_runner(
    *,
    config: ModelConfig,
    tensors: dict[str, Weight],
    options: RunnerOptions,
    layout: KVLayout,
    variant: ModelVariant = TARGET,
    tp: Collectives | None = None,
    followers: StepFollowers | None = None,
) -> ModelRunner:
    """A finished runner; consumes `tensors` (each weight is freed once its layer holds
    it). tp: this rank's group (it keeps its slice of heads, units and vocabulary);
    followers: rank 0's handle on the other ranks."""
    full_vocab = config.vocab_size
    if options.compile and config.is_moe:
        # Its routing groups rows by expert on the host: data-dependent, no one graph.
        raise ConfigError("compile", "compile=True does not run Mixture-of-Experts models yet")
    if tp is not None:
        check_tensor_parallel(config, tp.world_size, options.expert_parallel)
        shard_checkpoint(tensors, config, tp.rank, tp.world_size, options.dtype)
        config = local_config(config, tp.world_size)
    model = _build_model(config, options, variant)
    if tp is not None:
        model.set_tensor_parallel(tp, full_vocab)
    model.load_weights(tensors)
    model.init_rotary(layout.max_model_len)
    model.eval()
    lora = None
    if variant.lora is not None:
        lora = LoRASlotTable.attach(model, variant.lora, tp.rank if tp is not None else 0)
    if layout.kv_cache_dtype == "int8":
        kv_int8.check_head_dim(config.head_dim)
    backend = select_backend(options.device, options.dtype, config.head_dim)
    kv = allocate_kv_pools(config, layout, options.dtype, options.device)
    decode_stack = None
    if tp is None:  # small decode steps skip the Python model where our kernels run all of it
        decode_stack = LlamaDecodeStack.build(model, backend, kv.caches)
    else:  # its C++ layer loop has no all-reduce between the layers
        logger.info("tensor parallel: the fused decode stack is off (decode layer by layer)")
    return ModelRunner(
        config=config,
        model=model,
        # Dynamic in the number of tokens from the start, so one graph serves every
        # batch size (the quantized layers' row-count switch makes a second one).
        forward=torch.compile(model, dynamic=True, fullgraph=True) if options.compile else model,
        backend=backend,
        dtype=options.dtype,
        device=options.device,
        layout=layout,
        kv=kv,
        decode_stack=decode_stack,
        tp=tp,
        followers=followers,
        return_features=variant.return_features,
        pool_mode=variant.pool_mode,
        lora=lora,
    )


def _build_model(
    config: ModelConfig, options: RunnerOptions, variant: ModelVariant
) -> LlamaForCausalLM:
    """The module, built directly in the target dtype and device (no fp32 copy to
    convert), each Linear given the quantization method."""
    with _default_dtype(options.dtype), torch.device(options.device):
        model = (variant.model_type or model_class(config))(config)
        if variant.output_ids is not None:
            model.restrict_output(variant.output_ids)
    if options.quantization != "none":
        if options.device.type != "cpu":
            raise ValueError(f"quantization={options.quantization!r} runs on CPU kernels only")
        head = getattr(model, "lm_head", None)
        for layer in model.modules():
            if isinstance(layer, Linear):
                layer.method = make_linear_method(
                    options.quantization,
                    output_head=layer is head,
                    int8_prompts=options.int8_prompts,
                )
    return model


# The dense layers' weights among an embedding model's tensors (the loader's names).
_DENSE_PREFIX = "sentence_dense."


def build_encoder_runner(
    *,
    config: ModelConfig,
    tensors: dict[str, Weight],
    pooler: PoolerConfig,
    options: RunnerOptions,
) -> EncoderRunner:
    """An embedding model's runner: its encoder in the compute dtype, its pooler's dense
    layers in fp32; consumes `tensors`."""
    if options.quantization not in ("none", "gguf"):
        raise ConfigError(
            "quantization", f"quantization={options.quantization!r} does not run encoders yet"
        )
    dense = {
        name.removeprefix(_DENSE_PREFIX): tensors.pop(name)
        for name in [n for n in tensors if n.startswith(_DENSE_PREFIX)]
    }
    head = Pooler(pooler)
    head.dense.load_state_dict(dense)
    model: nn.Module
    if spec_of(config.architecture).encoder:
        floats = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
        if len(floats) != len(tensors):
            raise ConfigError("quantization", "an encoder's weights must be float tensors")
        with _default_dtype(options.dtype), torch.device(options.device):
            encoder = encoder_class(config)(config)
        encoder.load_weights(floats)
        model = encoder
    else:  # a decoder family run both ways (EmbeddingGemma)
        decoder = _build_model(config, options, TARGET)
        decoder.load_weights(tensors)
        decoder.init_rotary(pooler.max_tokens)
        model = BidirectionalDecoder(decoder)
    tensors.clear()
    model.eval()
    return EncoderRunner(config=config, model=model, pooler=head.eval(), device=options.device)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get their parameters in `dtype` (no fp32 copy to convert)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
