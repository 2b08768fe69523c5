"""Engine configuration: one place where every option is named, defaulted and validated."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from sluice.core.choices import (
    ARCHITECTURES,
    DEVICE_KINDS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_ROLES,
    LORA_DTYPES,
    PROMPT_ACTIVATIONS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    Architecture,
    DistributedExecutorBackend,
    DType,
    KVCacheDType,
    KVRole,
    LoRADType,
    PoolingMode,
    PromptActivations,
    Quantization,
    ReasoningParserName,
    SchedulingPolicy,
    SpeculativeMethod,
    WeightQuantization,
    is_device,
    one_of,
    parse_choice,
)
from sluice.core.errors import ConfigError
from sluice.core.lora import LoRARequest
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
    # Rope turns only the first `rotary_dim` dims of each head (Phi-4-mini: 96 of 128;
    # the model holds q/k rows in qk_row_order); None: all of them.
    rotary_dim: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    # OLMoE: that RMSNorm spans the whole q (and k) projection, every head together.
    qk_norm_per_head: bool = True
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
    # Granite's scalings: the embeddings times `embedding_multiplier`, each sublayer's
    # output times `residual_multiplier` before it joins the residual stream, scores
    # times `attention_multiplier` (instead of head_dim ** -0.5), the logits divided by
    # `logits_scaling`. 1.0 / None: Llama's.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Mixture-of-Experts (sluice/models/moe.py): each layer's MLP is `num_experts`
    # experts of `moe_intermediate_size` units, of which a router picks
    # `num_experts_per_tok` per token (softmax over all, top-k; the k weights
    # renormalized to sum to 1 where `norm_topk_prob`). 0 experts: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Granite-MoE's order instead: the top k of the raw logits, then a softmax over
    # those k (the same weights as a renormalized top k, rounded its own way).
    softmax_after_top_k: bool = False
    # A shared expert of this many units beside the routed ones, every token through
    # it; 0: none.
    shared_expert_intermediate_size: int = 0
    # Whether the shared expert's output is scaled by sigmoid(a learned projection) per
    # token (Qwen2-MoE) or added as it is (GraniteMoeShared).
    shared_expert_gated: bool = True
    # gpt-oss's experts: the router and every expert projection have biases, and an
    # expert's activation is the clamped SwiGLU where `swiglu_limit` is set: gate =
    # min(gate, limit), up clamped to [-limit, limit], out = (up + 1) * gate *
    # sigmoid(swiglu_alpha * gate). None: SiLU(gate) * up.
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # gpt-oss's attention: each head has a learned sink logit that joins every softmax's
    # denominator as a key with no value, and the output projection has a bias
    # (attention_bias is q/k/v's).
    attention_sinks: bool = False
    o_proj_bias: bool = False
    # Encoders (embedding models): every token attends to every other token of its
    # input, before and after it; such a model keeps no KV cache and computes an input
    # in one step (sluice/models/encoder.py, EmbeddingGemma's Gemma 3 layers).
    bidirectional: bool = False
    # BERT: learned token-type (segment) embeddings; 0: none.
    type_vocab_size: int = 0
    # MPNet: buckets of its relative position bias; 0: none.
    relative_attention_buckets: int = 0
    # The first token's absolute position id (MPNet counts from its padding id + 1).
    position_offset: int = 0

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        self._check_experts()
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
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0 == self.head_dim % 2
        ):
            raise ValueError(
                f"the rotary dims ({self.rotary_dim}) must be an even number below the "
                f"head's {self.head_dim} (even)"
            )
        for i in self.sliding_window_layers or ():
            if not 0 <= i < self.num_layers:
                raise ValueError(
                    f"sliding_window_layers lists layer {i}; the model has {self.num_layers}"
                )

    @property
    def attention_scale(self) -> float | None:
        """What attention scores are multiplied by; None: 1 / sqrt(head_dim), which
        each attention backend computes its own way."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        if self.query_pre_attn_scalar is not None:
            return float(float(self.query_pre_attn_scalar) ** -0.5)
        return None

    def qk_row_order(self, heads: int) -> torch.Tensor | None:
        """Where rope turns only `rotary_dim` of a head's dims (pairs i, i + rotary_dim
        / 2; Phi-4-mini): the order of a q or k projection's rows (of `heads` heads; new
        row -> stored row) that makes it the full half-split form (pairs j, j +
        head_dim / 2) whose last pairs do not turn (layers/rotary.py gives them cos 1,
        sin 0). Rotary pair i keeps i and moves i + rotary_dim / 2 to i + head_dim / 2;
        the unrotated dims fill the rest, half and half. The same order on q and k leaves
        every score unchanged, so each attention path and the fused decode stack run
        the model as a full-rotary one. None: the whole head turns, rows as stored."""
        if self.rotary_dim is None:
            return None
        d, rot = self.head_dim, self.rotary_dim
        rest = torch.arange(rot, d).view(2, -1)  # the unrotated dims, in two halves
        head = torch.cat([torch.arange(rot // 2), rest[0], torch.arange(rot // 2, rot), rest[1]])
        return (head + d * torch.arange(heads)[:, None]).reshape(-1)

    def _check_experts(self) -> None:
        """A Mixture-of-Experts shape that can run: k of E experts, 1 <= k <= E."""
        if self.num_experts == 0:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(
                f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}"
            )
        limit = self.swiglu_limit
        if limit is not None and not (isinstance(limit, (int, float)) and 0 < limit < math.inf):
            raise ValueError(f"swiglu_limit must be a positive number or None, got {limit!r}")

    @property
    def is_moe(self) -> bool:
        """Each layer's MLP is a set of routed experts."""
        return self.num_experts > 0

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


@dataclass(frozen=True)
class DenseLayer:
    """A linear projection after pooling (a sentence-transformers Dense module)."""

    in_features: int
    out_features: int
    bias: bool
    # "identity" or "tanh": what follows the projection.
    activation: str


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding model turns an input's hidden states into one vector: a
    sentence-transformers folder's modules after the transformer (Pooling, Dense,
    Normalize), read by sluice/loader/sentence_transformers.py."""

    mode: PoolingMode
    """Mean of the tokens, the first token's ([CLS]) or the last token's."""
    normalize: bool
    """The vector is scaled to unit length (its modules end in Normalize)."""
    dimension: int
    """The vector's length: the hidden size, or the last dense layer's output."""
    max_tokens: int
    """The longest input, in tokens with the special ones (its max_seq_length)."""
    dense: tuple[DenseLayer, ...] = ()
    """Projections applied after pooling, in order (EmbeddingGemma: 768 -> 3072 -> 768)."""
    matryoshka_dimensions: tuple[int, ...] = ()
    """Shorter lengths the vector was trained to be cut to (then renormalized); empty:
    only `dimension`."""
    prompts: tuple[tuple[str, str], ...] = ()
    """Named prefixes the model was trained with ("query" -> "task: search result |
    query: "), as its config lists them."""

    @property
    def dimensions(self) -> tuple[int, ...]:
        """Every length a request may ask for."""
        return tuple(sorted({self.dimension, *self.matryoshka_dimensions}, reverse=True))


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


# Hidden size from which prompt_activations="auto" takes int8: Qwen2.5-1.5B (1536) and
# larger. The bundled SmolLM2-135M (576) answers its first plain question differently
# with int8 activations in its prompt's matmuls (a near-tie, 0.125 apart in logprob,
# flips: tests/test_quantization.py), and its prompts already run at 2.9x llama.cpp's.
INT8_PROMPTS_MIN_HIDDEN = 1536


def resolve_prompt_activations(choice: str, hidden_size: int) -> bool:
    """Whether many-row matmuls on quantized weights take int8 activations."""
    chosen = parse_choice("prompt_activations", choice, PROMPT_ACTIVATIONS, ConfigError)
    if chosen == "auto":
        return hidden_size >= INT8_PROMPTS_MIN_HIDDEN
    return chosen == "int8"


def resolve_lora_dtype(choice: str, quantization: WeightQuantization) -> bool:
    """Whether adapters are stored as int8: beside quantized base weights (whose own
    error is far larger than int8's on an adapter's small product), or when asked for."""
    chosen = parse_choice("lora_dtype", choice, LORA_DTYPES, ConfigError)
    if chosen == "auto":
        return quantization != "none"
    return chosen == "int8"


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


def doc(help: str, default_text: str | None = None) -> dict[str, str]:
    """The metadata of an EngineConfig field, `field(default=..., metadata=doc(...))`:
    its help text, the one copy of it. `sluice serve --help` shows `help`, then the
    default: `default_text` where the value alone would not say what it means (None
    for "off")."""
    if default_text is None:
        return {"help": help}
    return {"help": help, "default_text": default_text}


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the OS has one (Linux), else
    every CPU the OS reports."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 2)


@dataclass
class EngineConfig:
    """Every option of LLM(...), of the CLI (--kebab-case) and of `sluice serve`.

    Each field's help text is in its metadata (`doc`), written once: the CLI's
    --help reads it from there; tests/test_config_help.py checks that every field has
    one and that README.md names every option."""

    model: str | None = field(
        default=None,
        metadata=doc(
            "the model: an alias (README.md lists them), a .gguf file, a Hugging Face "
            "directory (config.json, safetensors, tokenizer.json), or a Hugging Face Hub "
            "repo: org/repo (safetensors) or org/repo:QUANT (that quantization of a GGUF "
            "repo, e.g. :Q4_K_M, the default), downloaded into the Hub cache once",
            default_text="smollm2-135m, the bundled model",
        ),
    )
    revision: str | None = field(
        default=None,
        metadata=doc(
            "with a Hub repo as --model: the branch, tag or commit to use",
            default_text="main",
        ),
    )
    dtype: DType = field(
        default="auto",
        metadata=doc(
            "compute precision of weights and activations; auto: bfloat16 on CUDA and on CPUs "
            "with AVX512-BF16 or AMX, else float32. In float32 a seeded request samples the "
            "same tokens whatever the batch; in bfloat16 it may not"
        ),
    )
    device: str = field(
        default="auto",
        metadata=doc(f"{one_of(DEVICE_KINDS)} or cuda:N; auto: CUDA where torch sees it, else CPU"),
    )
    block_size: int = field(
        default=16,
        metadata=doc(
            "tokens per KV cache block, the unit the cache allocates, shares between requests "
            "with the same prefix and writes to the disk tier"
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=doc(
            "the longest sequence, prompt and output together, in tokens; never more than the "
            "KV cache holds",
            default_text="the model's own context length",
        ),
    )
    max_num_seqs: int = field(
        default=256,
        metadata=doc("at most this many requests run at once; later ones wait in the queue"),
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=doc(
            "the token budget of one step: each decoding request takes one, prompts are "
            "prefilled in chunks out of the rest"
        ),
    )
    kv_cache_memory: float = field(
        default=2.0,
        metadata=doc(
            "GiB for the K and V pools together (a draft model's pool included); it bounds "
            "how many tokens the running requests hold"
        ),
    )
    kv_cache_dtype: KVCacheDType = field(
        default="auto",
        metadata=doc(
            "how the KV cache stores K and V: auto, in the compute dtype; int8, int8 values "
            "with an fp16 scale per 32 channels (1.88x the tokens of bf16 in the same memory)"
        ),
    )
    kv_cache_skip_layers: tuple[int, ...] = field(
        default=(),
        metadata=doc(
            "with --kv-cache-dtype int8: layers (0-based; comma-separated on the command line, "
            "e.g. 0,29) whose K/V stay at full precision, in a pool of their own",
            default_text="none",
        ),
    )
    split_kv_pool: bool = field(
        default=True,
        metadata=doc(
            "for models with both windowed and full-attention layers (Gemma 3): keep the "
            "windowed layers' K/V in a pool of their own that holds only each sequence's "
            "window (engine/kv_cache.py); off: one pool, every layer's K/V for the whole "
            "sequence"
        ),
    )
    seed: int = field(
        default=0, metadata=doc("the seed of the engine's sampler, for requests that give none")
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=doc(
            "reuse the KV blocks of a prompt prefix that an earlier request computed (whole "
            "blocks, matched by content); --kv-offload-dir and --kv-role decode need it"
        ),
    )
    scheduling_policy: SchedulingPolicy = field(
        default="fcfs",
        metadata=doc(
            "the order requests are admitted and preempted in: fcfs, by arrival; priority, by "
            "each request's priority (lower first), then arrival"
        ),
    )
    quantization: Quantization = field(
        default="auto",
        metadata=doc(
            "weight-only quantization, on CPU kernels: gguf keeps a GGUF's quantized weights "
            "as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks, no float copy; "
            "MXFP4's 4-bit codes with a float16 scale a block); "
            "int8 and int4 quantize at load; none is dense; auto: gguf for a quantized GGUF on "
            "CPU unless --dtype float32 or float16 is asked for, else none"
        ),
    )
    prompt_activations: PromptActivations = field(
        default="auto",
        metadata=doc(
            "with --quantization gguf: how matmuls of many rows (prompts, many streams) take "
            "their activations; int8, quantized per block as decode steps and llama.cpp take "
            "them, on the int8 GEMM at AVX-512 (about 1.7-2x the float path's speed) and on "
            "the block kernel at AVX2; float, in the compute dtype on dequantized weight "
            "tiles; auto: int8 for models of hidden size 1536 and up, float below, where "
            "int8 noise moves answers more and the prompt's compute is small"
        ),
    )
    compile: bool = field(
        default=False,
        metadata=doc(
            "torch.compile the model (inductor), fusing each layer's elementwise work; the "
            "first steps of each shape class compile (a minute or more), cached on disk across "
            "runs"
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=doc(
            "torch threads on CPU, shared out among data-parallel replicas and tensor-parallel "
            "ranks; on machines with SMT, set it to the physical cores (sibling threads add "
            "contention)",
            default_text="one per CPU the OS reports",
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=doc(
            "a Jinja chat template instead of the model's own: a file, the template text, or "
            "a bundled name (hermes_tools: Hermes-style tool calling for ChatML models); "
            "compiled at start-up",
            default_text="the model's own",
        ),
    )
    reasoning_parser: ReasoningParserName | None = field(
        default=None,
        metadata=doc(
            "split a reasoning model's thinking (<think>...</think>; gpt-oss's analysis "
            "channel with openai_gptoss) from its answer in the server's replies: "
            "reasoning_content in chat completions, thinking blocks in the Messages API; "
            "tool calls are parsed from the answer only",
            default_text=(
                "off (the thinking stays in the reply's text), except openai_gptoss for a "
                "model whose chat template writes harmony (gpt-oss)"
            ),
        ),
    )
    speculative_method: SpeculativeMethod | None = field(
        default=None,
        metadata=doc(
            "speculative decoding, lossless: where draft tokens come from. ngram: prompt "
            "lookup over the prompt and the output so far; suffix: the longest earlier match "
            "in the request and in earlier requests' prompts and outputs; draft: a smaller "
            "model, --speculative-model; eagle: a one-layer head on the target's own hidden "
            "states, bundled for SmolLM2 (training/train_eagle.py trains others)",
            default_text="off",
        ),
    )
    num_speculative_tokens: int = field(
        default=4,
        metadata=doc(
            f"at most this many draft tokens a request verifies per step "
            f"(1..{MAX_SPECULATIVE_TOKENS}); the speculator drafts fewer, or none, where their "
            "measured cost says they would not pay (engine/speculative/speculator.py)"
        ),
    )
    speculative_draft_cost: float | None = field(
        default=None,
        metadata=doc(
            "what verifying one draft token costs, as a fraction of a decode step, at every "
            "batch size (a draft model's drafting counted free): the speculator plans with "
            "this instead of measuring the step-cost table at start-up, which takes seconds "
            "on the bundled model and tens of them on a 1.5B. 0 verifies every draft it can",
            default_text="measured once per model, drafter and machine, then cached",
        ),
    )
    speculative_model: str | None = field(
        default=None,
        metadata=doc(
            "the draft model of --speculative-method draft (giving it alone implies that "
            "method): an alias, .gguf file or Hugging Face directory, with the target's "
            "tokenizer; with --speculative-method eagle, the head's .safetensors file "
            "(training/train_eagle.py)",
            default_text="none; for eagle, the bundled head for the target",
        ),
    )
    speculative_draft_vocab_size: int = field(
        default=65536,
        metadata=doc(
            "the draft model's output head covers only its first N token ids and the "
            "tokenizer's added tokens (0: the whole vocabulary). BPE ids run roughly from "
            "frequent to rare, and a 151,936-token head is 37% of the bytes a 0.5B model reads "
            "per step: cut to 64K ids it reads 43% of them. Where the target's token lies "
            "outside, the draft is rejected: the output is unchanged"
        ),
    )
    kv_offload_dir: str | None = field(
        default=None,
        metadata=doc(
            "a directory for the disk tier under the prefix cache: finished requests' full KV "
            "blocks are written there (one checksummed file each) and loaded by later "
            "requests whose prefix is no longer in RAM, also after a restart",
            default_text="off",
        ),
    )
    kv_offload_size: float = field(
        default=8.0,
        metadata=doc("GiB of block files the disk tier keeps, least recently used deleted first"),
    )
    kv_role: KVRole | None = field(
        default=None,
        metadata=doc(
            "prefill/decode disaggregation: prefill holds the KV blocks of the prompts of "
            "requests that ask for it (kv_transfer_params) for a decode instance to pull over "
            "TCP; decode pulls them instead of computing them (`sluice serve --role` sets it)",
            default_text="off",
        ),
    )
    kv_transfer_host: str = field(
        default="127.0.0.1",
        metadata=doc(
            "where a prefill instance's KV block server listens; a decode instance on another "
            "host needs an address it reaches"
        ),
    )
    kv_transfer_port: int = field(
        default=0,
        metadata=doc(
            "the port of a prefill instance's KV block server; 0: any free port (responses name it)"
        ),
    )
    kv_transfer_timeout: float = field(
        default=60.0,
        metadata=doc(
            "seconds a prefill instance holds a prompt's blocks for a decode instance that "
            "does not confirm it pulled them, and a pull waits for a silent peer"
        ),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=doc(
            "engine replicas behind one server, each its own process (or Ray actor) with its "
            "own threads and KV pool; a request goes to the replica holding its prefix, else "
            "the least loaded; 1: the engine runs in the server's process"
        ),
    )
    distributed_executor_backend: DistributedExecutorBackend = field(
        default="mp",
        metadata=doc(
            "how data-parallel replicas run: mp, processes on this machine; ray, Ray actors on "
            "a Ray cluster (joins the one `ray start` made, else starts a local one; pip "
            "install 'sluice[dist]')"
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=doc(
            "split every layer's heads and units, the KV heads and the vocabulary over this "
            "many ranks (this process and N - 1 workers on this machine) that run each step "
            "together; the heads and KV heads must divide by it"
        ),
    )

    enable_expert_parallel: bool = field(
        default=False,
        metadata=doc(
            "with tensor_parallel_size N, split a Mixture-of-Experts model's experts over the "
            "N ranks (whole experts each; attention split by heads as without it); the expert "
            "count must divide by N"
        ),
    )

    enable_lora: bool = field(
        default=False,
        metadata=doc(
            "serve LoRA adapters beside the base model: a request names one as its `model` "
            "(the server) or passes lora_request (Python); requests for different adapters "
            "and for the base run in one step, the base weights shared"
        ),
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "with --enable-lora, adapters served by name: NAME=PATH each (a PEFT adapter "
            "folder or a llama.cpp .gguf adapter), space-separated on the command line; more "
            "load at run time (POST /v1/load_lora_adapter)",
            default_text="none",
        ),
    )
    max_loras: int = field(
        default=4,
        metadata=doc(
            "with --enable-lora, adapters that can run in one step (slots beside every "
            "adapted layer); a request for another adapter waits until a slot's requests finish"
        ),
    )
    max_lora_rank: int = field(
        default=16,
        metadata=doc("with --enable-lora, the highest adapter rank accepted (the slots' size)"),
    )
    lora_dtype: LoRADType = field(
        default="auto",
        metadata=doc(
            "with --enable-lora, how adapters' matrices are stored: int8 (a scale per row of "
            "A and per column of B; half the bytes of bf16, which is what an adapter adds to "
            "a decode step), model (the compute dtype: equal to PEFT's output in float32); "
            "auto: int8 beside quantized base weights, model beside dense ones"
        ),
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata=doc(
            "with --enable-lora, adapters kept loaded in memory (at least max_loras), least "
            "recently used dropped (reloaded from their files when asked for again)",
            default_text="max_loras",
        ),
    )

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
        self.prompt_activations = parse_choice(
            "prompt_activations", self.prompt_activations, PROMPT_ACTIVATIONS, ConfigError
        )
        self.dtype = parse_choice("dtype", self.dtype, DTYPES, ConfigError)
        self._check_kv_cache_dtype()
        self.distributed_executor_backend = parse_choice(
            "distributed_executor_backend",
            self.distributed_executor_backend,
            DISTRIBUTED_EXECUTOR_BACKENDS,
            ConfigError,
        )
        if self.reasoning_parser is not None:
            self.reasoning_parser = parse_choice(
                "reasoning_parser", self.reasoning_parser, REASONING_PARSERS, ConfigError
            )
        self._check_speculation()
        self._check_offload()
        self._check_kv_transfer()
        self._check_tensor_parallel()
        self._check_lora()
        for name in ("chat_template", "revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(name, f"{name} must be a non-empty string, got {value!r}")
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

    def _check_lora(self) -> None:
        self.lora_dtype = parse_choice("lora_dtype", self.lora_dtype, LORA_DTYPES, ConfigError)
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"{name} must be a positive integer, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (
            not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras
        ):
            raise ConfigError(
                "max_cpu_loras", f"max_cpu_loras must be an integer >= max_loras, got {cpu!r}"
            )
        modules = self.lora_modules
        if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
            raise ConfigError(
                "lora_modules", f"lora_modules must be NAME=PATH strings, got {modules!r}"
            )
        self.lora_modules = tuple(modules)
        for entry in self.lora_modules:
            name, _, path = entry.partition("=")
            if not name.strip() or not path.strip():
                raise ConfigError(
                    "lora_modules", f"lora_modules entries are NAME=PATH, got {entry!r}"
                )
        names = [r.lora_name for r in self.lora_requests()]
        if len(set(names)) != len(names):
            raise ConfigError("lora_modules", f"lora_modules names an adapter twice: {names}")
        if not self.enable_lora:
            if self.lora_modules:
                raise ConfigError("lora_modules", "lora_modules needs enable_lora")
            return
        if self.compile:
            raise ConfigError(
                "enable_lora", "enable_lora cannot be combined with compile=True (not implemented)"
            )

    def lora_requests(self) -> list[LoRARequest]:
        """lora_modules as the requests that name them (ids from 1, in order): the one
        reading of NAME=PATH, for the engine's registry and the data-parallel front end."""
        pairs = (entry.partition("=") for entry in self.lora_modules)
        return [
            LoRARequest(name.strip(), i, path.strip())
            for i, (name, _, path) in enumerate(pairs, start=1)
        ]

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
        cost = self.speculative_draft_cost
        if cost is not None and (
            isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 <= cost < math.inf
        ):
            raise ConfigError(
                "speculative_draft_cost",
                "speculative_draft_cost must be a finite number >= 0 (a fraction of a decode "
                f"step), got {cost!r}",
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
        # One torch thread per CPU this process may run on (its affinity: a container's
        # or taskset's share, not the whole machine); set num_threads to use physical
        # cores only on machines with SMT, where the sibling threads add contention.
        return self.num_threads or usable_cpus()

    def rank_threads(self) -> int:
        """Torch threads of each tensor-parallel rank: the ranks share the CPUs."""
        return max(1, self.threads() // self.tensor_parallel_size)
