"""Every closed list of choices, written once.

Each is a `Literal` type, for annotations and the type checker, and a tuple of its
values (`typing.get_args`), for run-time checks, CLI `choices=` and messages. Config
validation, the CLI, the model registry, the loaders and the server protocol derive
from these; adding a value here is the one edit that makes it known everywhere.
"""

from __future__ import annotations

import re
from typing import Literal, TypeVar, get_args

from sluice.core.errors import InvalidValueError

# Compute precision of the weights and activations; "auto": bf16 on CUDA and on CPUs
# with AVX512-BF16/AMX, fp32 elsewhere.
DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[DType, ...] = get_args(DType)

# Weight-only quantization as asked for: "gguf" runs a GGUF's quantized weights as
# stored, in their block formats; "auto" picks that on CPU (see
# config.resolve_quantization); "int8"/"int4" (re)quantize at load; "none" is dense.
Quantization = Literal["auto", "none", "int8", "int4", "gguf"]
QUANTIZATIONS: tuple[Quantization, ...] = get_args(Quantization)

# What "auto" resolves to: the method each Linear layer is given.
WeightQuantization = Literal["none", "int8", "int4", "gguf"]
WEIGHT_QUANTIZATIONS: tuple[WeightQuantization, ...] = get_args(WeightQuantization)

# Model families sluice implements (ModelConfig.architecture): decoders, then the
# encoders of embedding models; each registered once in sluice/architectures/, whose
# REGISTRY lists exactly these, in this order.
Architecture = Literal[
    "llama",
    "qwen2",
    "qwen3",
    "gemma3",
    "granite",
    "phi3",
    "qwen2moe",
    "qwen3moe",
    "olmoe",
    "granitemoe",
    "gpt_oss",
    "bert",
    "mpnet",
]
ARCHITECTURES: tuple[Architecture, ...] = get_args(Architecture)

# How an embedding model turns a sequence's hidden states into one vector: the mean of
# its tokens, its first token's (BERT's [CLS]), or its last token's (a decoder's).
PoolingMode = Literal["mean", "cls", "last"]
POOLING_MODES: tuple[PoolingMode, ...] = get_args(PoolingMode)

# What a LoRA adapter may adapt, by the names PEFT and transformers give them in
# Llama-family decoders: each layer's projections (sluice/layers/lora.py maps them
# onto the fused q/k/v and gate/up layers), and the model's token embedding and head.
LoRAProjection = Literal[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
]
LoRAModelTarget = Literal["embed_tokens", "lm_head"]
LoRATarget = LoRAProjection | LoRAModelTarget
LORA_TARGETS: tuple[LoRAProjection, ...] = get_args(LoRAProjection)
LORA_MODEL_TARGETS: tuple[LoRAModelTarget, ...] = get_args(LoRAModelTarget)

# How LoRA adapters' matrices are stored in their slots: "model" in the compute dtype;
# "int8" with a scale per row of A and per column of B (half of bf16's bytes, which
# is what an adapter costs a decode step); "auto": int8 beside quantized base
# weights, the model's dtype beside dense ones (config.resolve_lora_dtype).
LoRADType = Literal["auto", "int8", "model"]
LORA_DTYPES: tuple[LoRADType, ...] = get_args(LoRADType)

# How many-row matmuls (prompts, many streams) on GGUF-quantized weights take their
# activations: "int8" as the block kernel and llama.cpp do, on the int8 GEMM; "float"
# in the compute dtype, on dequantized tiles; "auto" by model size
# (config.resolve_prompt_activations).
PromptActivations = Literal["auto", "int8", "float"]
PROMPT_ACTIVATIONS: tuple[PromptActivations, ...] = get_args(PromptActivations)

# How the KV cache stores K and V: "auto" in the compute dtype, "int8" as int8 rows
# with an fp16 scale per 32 channels (sluice/attention/kv_int8.py).
KVCacheDType = Literal["auto", "int8"]
KV_CACHE_DTYPES: tuple[KVCacheDType, ...] = get_args(KVCacheDType)

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = get_args(SchedulingPolicy)

# Device kinds; a CUDA device may also be named with an index, "cuda:N".
DeviceKind = Literal["auto", "cpu", "cuda"]
DEVICE_KINDS: tuple[DeviceKind, ...] = get_args(DeviceKind)
_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")

# Why a sequence ended (CompletionOutput.finish_reason, OpenAI's finish_reason).
FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)

# Instruction-set levels of the CPU kernel variants, lowest first (SLUICE_CPU_ISA).
CpuIsa = Literal["generic", "avx2", "avx512", "amx"]
CPU_ISAS: tuple[CpuIsa, ...] = get_args(CpuIsa)

# Where draft tokens for speculative decoding come from ("ngram": prompt lookup;
# "suffix": longest matches in the request and in earlier requests; "draft": a smaller
# model with the same tokenizer, EngineConfig.speculative_model).
SpeculativeMethod = Literal["ngram", "suffix", "draft", "eagle"]
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = get_args(SpeculativeMethod)

# How a reasoning model marks its thinking (sluice/server/reasoning.py): "qwen3" and
# "deepseek_r1" both write <think>...</think>; R1's output may lack the opening tag;
# "openai_gptoss" (vLLM's name): gpt-oss's harmony channels.
ReasoningParserName = Literal["qwen3", "deepseek_r1", "openai_gptoss"]
REASONING_PARSERS: tuple[ReasoningParserName, ...] = get_args(ReasoningParserName)

# How data-parallel replicas run: "mp", processes on this machine; "ray", Ray actors
# placed by a Ray cluster (several machines).
# A prefill/decode split: "prefill" computes prompts and holds their KV blocks for a
# decode instance to pull; "decode" pulls them and generates (kv_connector/pd_*.py).
KVRole = Literal["prefill", "decode"]
KV_ROLES: tuple[KVRole, ...] = get_args(KVRole)

DistributedExecutorBackend = Literal["mp", "ray"]
DISTRIBUTED_EXECUTOR_BACKENDS: tuple[DistributedExecutorBackend, ...] = get_args(
    DistributedExecutorBackend
)

# How tensor-parallel ranks on CPU all-reduce (SLUICE_TP_ALLREDUCE): "shm" through
# shared memory on one host, "gloo" through torch.distributed; "auto" prefers shm.
TPAllReduce = Literal["auto", "shm", "gloo"]
TP_ALLREDUCES: tuple[TPAllReduce, ...] = get_args(TPAllReduce)

LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)

T = TypeVar("T", bound=str)


def one_of(choices: tuple[str, ...]) -> str:
    """`a, b, c`: the choices as a message or a help text lists them."""
    return ", ".join(choices)


def is_device(value: object) -> bool:
    """True for "auto", "cpu", "cuda" and "cuda:N"."""
    return isinstance(value, str) and _DEVICE_RE.fullmatch(value) is not None


def choice_error(name: str, value: object, choices: tuple[str, ...]) -> str:
    """The one wording of "not one of the choices", used by every check."""
    return f"{name} must be one of {one_of(choices)}; got {value!r}"


def parse_choice(
    name: str,
    value: object,
    choices: tuple[T, ...],
    error: type[InvalidValueError] = InvalidValueError,
) -> T:
    """`value` as one of `choices`, typed as their Literal; otherwise `error` (a
    ValueError) naming `name`, worded by `choice_error`."""
    for choice in choices:
        if value == choice:
            return choice
    raise error(name, choice_error(name, value, choices))


__all__ = [
    "ARCHITECTURES",
    "CPU_ISAS",
    "DEVICE_KINDS",
    "DTYPES",
    "FINISH_REASONS",
    "LOG_LEVELS",
    "POOLING_MODES",
    "QUANTIZATIONS",
    "SCHEDULING_POLICIES",
    "TP_ALLREDUCES",
    "WEIGHT_QUANTIZATIONS",
    "Architecture",
    "CpuIsa",
    "DType",
    "DeviceKind",
    "FinishReason",
    "LogLevel",
    "PoolingMode",
    "Quantization",
    "SchedulingPolicy",
    "TPAllReduce",
    "WeightQuantization",
    "choice_error",
    "is_device",
    "one_of",
    "parse_choice",
]
