"""Engine configuration: one place where every option is named, defaulted and validated."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import torch

from sluice.core.choices import (
    ARCHITECTURES,
    DEVICE_KINDS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_ROLES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    Architecture,
    DistributedExecutorBackend,
    DType,
    KVCacheDType,
    KVRole,
    Quantization,
    SchedulingPolicy,
    SpeculativeMethod,
    WeightQuantization,
    is_device,
    one_of,
    parse_choice,
)
from sluice.core.errors import ConfigError
from sluice.kernels import cpu


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, read from GGUF metadata or a HF config.json."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    hidden_act: str = "silu"
    name: str = "model"
    # Sliding-window attention: a query sees its last `sliding_window` positions
    # (itself included) in the layers listed in `sliding_window_layers`, or in every
    # layer where that is None (Mistral). Gemma 3 interleaves local and global layers.
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    # Rope base of the windowed layers where it differs from rope_theta (Gemma 3's
    # local layers: 10k, global ones 1M); rope_scaling applies to the global ones only.
    rope_local_theta: float | None = None
    # Scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma).
    query_pre_attn_scalar: float | None = None
    # Logits become cap * tanh(logits / cap) (Gemma 2 and 3 configs may set it).
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive integer or None, got {self.sliding_window!r}"
            )
        for i in self.sliding_window_layers or ():
            if not 0 <= i < self.num_layers:
                raise ValueError(
                    f"sliding_window_layers lists layer {i}; the model has {self.num_layers}"
                )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    def split_kv_local_layers(self) -> list[int]:
        """The windowed layers of a model that has full-attention layers too (Gemma 3):
        those a split KV cache keeps in its local pool. Empty where every layer is
        windowed (Mistral) or none is: such a model keeps one pool."""
        local = [i for i in range(self.num_layers) if self.layer_window(i) is not None]
        return local if 0 < len(local) < self.num_layers else []

    def kv_window(self) -> int | None:
        """The window of the KV cache as a whole: the largest layer window where every
        layer has one (no position before it is ever read again), else None."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)


# The layer groups of a split KV cache (engine/kv_cache.py): the full-attention layers
# (the only group of a single pool) and the windowed ones, each with its own pool.
GLOBAL_KV_GROUP = 0
LOCAL_KV_GROUP = 1


def check_architecture(arch: object) -> Architecture:
    """`arch` if sluice implements it (a family registered in sluice/architectures/);
    ModelConfig and sluice.architectures.spec_of call this."""
    for known in ARCHITECTURES:
        if arch == known:
            return known
    raise ValueError(
        f"unsupported model architecture {arch!r}; sluice supports: {one_of(ARCHITECTURES)}"
    )


_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if parse_choice("dtype", dtype, DTYPES, ConfigError) != "auto":
        return _TORCH_DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu.has_native_bf16() else torch.float32


def resolve_quantization(
    quantization: str,
    device: torch.device,
    dtype: torch.dtype,
    quantized_file: bool,
    dtype_requested: str = "auto",
) -> WeightQuantization:
    """'auto' runs a quantized GGUF as stored ("gguf") on CPU, where our block kernels
    run at every instruction-set level: in bf16, and in fp32 where fp32 was chosen
    because the CPU has no native bf16 (AVX2). An fp32 the user asked for stays the
    exact, unquantized mode the tests compare with transformers in; float files and
    other devices stay dense."""
    chosen = parse_choice("quantization", quantization, QUANTIZATIONS, ConfigError)
    if chosen == "gguf" and not quantized_file:
        raise ConfigError(
            "quantization", "quantization='gguf' needs a GGUF file with quantized weights"
        )
    if chosen != "auto":
        return chosen
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return "none"
    if dtype == torch.float32 and dtype_requested != "auto":
        return "none"
    return "gguf" if quantized_file else "none"


# A verifying request's 1 + k query tokens stay a short chunk for the paged attention
# kernel (the runner's SMALL_CHUNK_TOKENS, 16).
MAX_SPECULATIVE_TOKENS = 15


@dataclass
class EngineConfig:
    """Every option of LLM(...), of the CLI (--kebab-case) and of `sluice serve`."""

    model: str | None = None
    dtype: DType = "auto"
    device: str = "auto"  # auto, cpu, cuda or cuda:N
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: float = 2.0  # GiB for the K and V pools together
    # How K/V are stored: "auto" (the compute dtype) or "int8" (int8 rows with fp16
    # scales: 1.88x the tokens of bf16 in the same memory). kv_cache_skip_layers keeps
    # the listed layers (0-based) at full precision in a pool of their own.
    kv_cache_dtype: KVCacheDType = "auto"
    kv_cache_skip_layers: tuple[int, ...] = ()
    # Where a model has both windowed and full-attention layers (Gemma 3), keep the
    # windowed layers' K/V in a pool of their own that holds only each sequence's
    # window (engine/kv_cache.py); False: one pool for every layer, the whole sequence.
    split_kv_pool: bool = True
    seed: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    # Weight-only, on CPU kernels: "none", "int8", "int4", "gguf" (a GGUF's quantized
    # weights as stored), or "auto": "gguf" for a quantized GGUF on CPU unless fp32
    # was asked for.
    quantization: Quantization = "auto"
    # torch.compile the model (inductor): fuses the per-layer elementwise work; costs a
    # compile at the first steps of each shape class (cached on disk across runs).
    compile: bool = False
    num_threads: int | None = None
    # A Jinja chat template instead of the model's own (vLLM's --chat-template): a
    # file, the template text, or a bundled name ("hermes_tools": tool calling for
    # ChatML models). The loader resolves and compiles it at start-up.
    chat_template: str | None = None
    # Speculative decoding: where draft tokens come from (None: off) and at most how
    # many a request verifies per step (the speculator picks fewer, or none, where
    # they would not pay; see sluice/engine/speculative/speculator.py).
    speculative_method: SpeculativeMethod | None = None
    num_speculative_tokens: int = 4
    # The draft model of speculative_method="draft" (an alias, .gguf or HF directory
    # like `model`); it must share the target's tokenizer. Giving it alone implies
    # speculative_method="draft". With "eagle": the head's .safetensors file
    # (training/train_eagle.py); None picks the bundled head trained for the target.
    speculative_model: str | None = None
    # The draft model's output head covers its first this-many token ids and the
    # tokenizer's added tokens only (0: its whole vocabulary). BPE ids run roughly from
    # frequent to rare, and a 151,936-token head is 37% of the bytes a 0.5B model reads
    # per step: cut to 64K ids it reads 43% of them, and the draft is rejected where
    # the target's token lies outside (output is unchanged).
    speculative_draft_vocab_size: int = 65536
    # The disk tier under the prefix cache: full blocks of finished requests are written
    # to this directory (one file each, checksummed) and loaded by later requests whose
    # prefix misses in RAM but is on disk; it survives restarts. At most kv_offload_size
    # GiB of files, least recently used deleted first. None: off.
    kv_offload_dir: str | None = None
    kv_offload_size: float = 8.0
    # Prefill/decode disaggregation (None: off). "prefill": requests that ask for it
    # (kv_transfer_params) leave their prompt's KV blocks on a TCP block server at
    # kv_transfer_host:kv_transfer_port (0: any free port) for kv_transfer_timeout
    # seconds or until a decode instance confirms it pulled them; "decode": requests
    # that name such a transfer pull the blocks instead of computing them.
    kv_role: KVRole | None = None
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0
    kv_transfer_timeout: float = 60.0
    # Data parallelism: this many whole engines (each its own process, threads and KV
    # pool) behind one front end; 1 runs the engine in the serving process itself.
    data_parallel_size: int = 1
    # How the replicas run: "mp" (processes on this machine) or "ray" (Ray actors,
    # on any machine of a Ray cluster).
    distributed_executor_backend: DistributedExecutorBackend = "mp"
    # Tensor parallelism: this many ranks (this process and N - 1 workers on this
    # machine) each hold 1/N of every layer's heads and units and of the vocabulary, and
    # run every step together; torch threads are shared out between them.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"{name} must be a positive integer, got {value!r}")

        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "data_parallel_size",
            "tensor_parallel_size",
        ):
            positive(name)
        if self.max_model_len is not None:
            positive("max_model_len")
        if not isinstance(self.split_kv_pool, bool):
            raise ConfigError(
                "split_kv_pool", f"split_kv_pool must be True or False, got {self.split_kv_pool!r}"
            )
        if not (isinstance(self.kv_cache_memory, int | float) and self.kv_cache_memory > 0):
            raise ConfigError(
                "kv_cache_memory",
                f"kv_cache_memory must be a positive number of GiB, got {self.kv_cache_memory!r}",
            )
        self.scheduling_policy = parse_choice(
            "scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES, ConfigError
        )
        self.quantization = parse_choice(
            "quantization", self.quantization, QUANTIZATIONS, ConfigError
        )
        self.dtype = parse_choice("dtype", self.dtype, DTYPES, ConfigError)
        self._check_kv_cache_dtype()
        self.distributed_executor_backend = parse_choice(
            "distributed_executor_backend",
            self.distributed_executor_backend,
            DISTRIBUTED_EXECUTOR_BACKENDS,
            ConfigError,
        )
        self._check_speculation()
        self._check_offload()
        self._check_kv_transfer()
        self._check_tensor_parallel()
        if self.chat_template is not None and (
            not isinstance(self.chat_template, str) or not self.chat_template.strip()
        ):
            raise ConfigError(
                "chat_template",
                f"chat_template must be a non-empty string, got {self.chat_template!r}",
            )
        if not is_device(self.device):
            raise ConfigError(
                "device",
                f"device must be one of {one_of(DEVICE_KINDS)} or cuda:N; got {self.device!r}",
            )

    def _check_offload(self) -> None:
        size = self.kv_offload_size
        if isinstance(size, bool) or not isinstance(size, int | float) or not size > 0:
            raise ConfigError(
                "kv_offload_size",
                f"kv_offload_size must be a positive number of GiB, got {size!r}",
            )
        directory = self.kv_offload_dir
        if directory is None:
            return
        if not isinstance(directory, str) or not directory.strip():
            raise ConfigError(
                "kv_offload_dir", f"kv_offload_dir must be a directory path, got {directory!r}"
            )
        if not self.enable_prefix_caching:
            raise ConfigError(
                "kv_offload_dir",
                "kv_offload_dir is a tier under the prefix cache: it needs "
                "enable_prefix_caching=True",
            )

    def _check_kv_transfer(self) -> None:
        if self.kv_role is None:
            return
        self.kv_role = parse_choice("kv_role", self.kv_role, KV_ROLES, ConfigError)
        if self.kv_offload_dir is not None:
            raise ConfigError(
                "kv_role", "kv_role and kv_offload_dir are both KV connectors; pick one"
            )
        if self.kv_role == "decode" and not self.enable_prefix_caching:
            raise ConfigError(
                "kv_role",
                "kv_role='decode' loads blocks the way prefix-cache hits are loaded: it "
                "needs enable_prefix_caching=True",
            )
        port, timeout = self.kv_transfer_port, self.kv_transfer_timeout
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ConfigError(
                "kv_transfer_port", f"kv_transfer_port must be 0..65535, got {port!r}"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ConfigError(
                "kv_transfer_timeout",
                f"kv_transfer_timeout must be a positive number of seconds, got {timeout!r}",
            )
        if not isinstance(self.kv_transfer_host, str) or not self.kv_transfer_host:
            raise ConfigError("kv_transfer_host", "kv_transfer_host must be a host name")

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not combine with (yet), named."""
        if self.tensor_parallel_size == 1:
            return
        clashes = {
            "data_parallel_size": self.data_parallel_size > 1,
            "distributed_executor_backend": self.distributed_executor_backend == "ray",
            "compile": self.compile,
            "kv_offload_dir": self.kv_offload_dir is not None,
            "kv_role": self.kv_role is not None,
            "speculative_method": self.speculative_method in ("draft", "eagle"),
        }
        for name, clash in clashes.items():
            if clash:
                raise ConfigError(
                    "tensor_parallel_size",
                    f"tensor_parallel_size > 1 cannot be combined with {name}="
                    f"{getattr(self, name)!r} (not implemented)",
                )

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            raise ConfigError(
                "kv_cache_dtype",
                "kv_cache_dtype='fp8' is not supported: CPUs have no fp8 arithmetic, and "
                "'int8' stores the same bytes per value with finer (per 32 channels) scales",
            )
        self.kv_cache_dtype = parse_choice(
            "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES, ConfigError
        )
        layers = self.kv_cache_skip_layers or ()
        if isinstance(layers, int | str) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
        ):
            raise ConfigError(
                "kv_cache_skip_layers",
                f"kv_cache_skip_layers must be layer indices (integers >= 0), got {layers!r}",
            )
        self.kv_cache_skip_layers = tuple(sorted(set(layers)))
        if self.kv_cache_skip_layers and self.kv_cache_dtype == "auto":
            raise ConfigError(
                "kv_cache_skip_layers",
                "kv_cache_skip_layers keeps layers out of a quantized KV cache; it needs "
                "kv_cache_dtype='int8'",
            )

    def _check_speculation(self) -> None:
        if self.speculative_method is None and self.speculative_model is not None:
            self.speculative_method = "draft"
        if self.speculative_method is not None:
            self.speculative_method = parse_choice(
                "speculative_method", self.speculative_method, SPECULATIVE_METHODS, ConfigError
            )
        self._check_speculative_model()
        size = self.speculative_draft_vocab_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(
                "speculative_draft_vocab_size",
                "speculative_draft_vocab_size must be a non-negative integer (0: the whole "
                f"vocabulary), got {size!r}",
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                "num_speculative_tokens",
                f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}",
            )

    def _check_speculative_model(self) -> None:
        model = self.speculative_model
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise ConfigError(
                "speculative_model", f"speculative_model must be a model name, got {model!r}"
            )
        if self.speculative_method == "draft" and model is None:
            raise ConfigError(
                "speculative_model",
                "speculative_method='draft' needs speculative_model (the draft model: an "
                "alias, a .gguf file or a Hugging Face directory)",
            )
        if self.speculative_method not in ("draft", "eagle") and model is not None:
            raise ConfigError(
                "speculative_model",
                f"speculative_model is for speculative_method='draft' or 'eagle', not "
                f"{self.speculative_method!r}",
            )

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        unknown = set(kwargs) - set(cls.option_names())
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def threads(self) -> int:
        # One torch thread per CPU the OS reports; set num_threads to use physical cores
        # only on machines with SMT, where the sibling threads add contention.
        return self.num_threads or max(1, (os.cpu_count() or 2))

    def rank_threads(self) -> int:
        """Torch threads of each tensor-parallel rank: the ranks share the CPUs."""
        return max(1, self.threads() // self.tensor_parallel_size)
