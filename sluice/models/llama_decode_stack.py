"""The Llama decoder stack in one C++ call, for CPU decode steps of a few tokens.

A 1-token step through the Python model spends about as long in per-op overhead
(Python, the call into C, OpenMP fork/join for each of ~300 kernel calls) as in
arithmetic.
`sluice_decode_stack` (sluice/kernels/csrc/decode_stack.cpp) runs all layers inside
one parallel region with the same kernels, so it returns exactly what the model's
forward would. It applies where every one of those kernels is ours: CPU, every linear on one of our
weight kernels (int4, per-channel int8, or a GGUF weight kept in a qblock layout; each
linear has its own format, as GGUF files mix them per layer), the paged attention
kernel; QK-norm (per head or over the whole projections), sliding windows per layer,
Mixture-of-Experts MLPs whose expert stacks stay in GGUF blocks (no shared expert), and
gpt-oss's sinks, biases, routing and clamped SwiGLU; and to steps whose every
token is a short-chunk query with fewer rows than any of those linears (or experts)
hands to its dense path.
Anything else goes through the model as usual.

Each layer's pointers are filled by field name (`layer_fields`); the binding orders them
as the library reports its fields (sluice/kernels/decode_stack.py), so the table's
layout is defined once, in sluice/kernels/csrc/decode_stack_fields.h.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from sluice import kernels
from sluice.attention.backend import AttentionBackend, AttentionMetadata
from sluice.config import ModelConfig
from sluice.core.quantized_tensor import QuantizedTensor
from sluice.kernels import Library, decode_stack, qblock
from sluice.kernels import fused as fused_kernels
from sluice.kernels.decode_stack import Field
from sluice.layers.block_quant import DENSE_MIN_ROWS, BlockQuantized
from sluice.layers.linear import Linear
from sluice.layers.quantization import Int4WeightOnly, Int8WeightOnly
from sluice.models.llama import DecoderLayer, LlamaForCausalLM
from sluice.models.mlp import MLP
from sluice.models.moe import SparseMoE

STACK_MAX_ROWS = 3
# Rows a step may have where every linear and expert takes the int8 GEMM from one row
# count on, as the eager layers do (a model with int8 prompts at a level with the GEMM):
# the stack then runs the GEMM there too, so 12-32 decoding streams take one call
# instead of the eager layers' (~28 ms of Python and torch ops in a 16-stream step of
# OLMoE-1B-7B, 243 ms, on 2 cores of an AMX Xeon: cProfile, ad hoc). Past 32 rows a step
# is a prompt's, which the paged kernel does not take anyway.
STACK_GEMM_MAX_ROWS = 32
QBLOCK_FORMATS = frozenset(
    decode_stack.qblock_format(bits, group, panels)
    for bits, group in qblock.FORMATS
    for panels in (False, True)
)

# A layer's row of the stack's table: field name (csrc/decode_stack_fields.h) -> tensor,
# None for a null pointer, or an int (a linear's format).
Fields = dict[str, Field]


class _KernelMethod(Protocol):
    """What the stack reads off a weight-only method on our kernels."""

    lib: Library | None
    dense_min_rows: int  # rows from which the eager layer runs its dense path instead


class _QBlockMethod(_KernelMethod, Protocol):
    @property
    def bits(self) -> int: ...
    @property
    def group(self) -> int: ...
    @property
    def panels(self) -> bool: ...


def _tensor(layer: Linear, name: str) -> torch.Tensor:
    """A weight tensor the layer's method attached (build time only)."""
    t = getattr(layer, name)
    assert isinstance(t, torch.Tensor), name
    return t


def _qblock_weights(layer: Linear) -> tuple[int, tuple[Field, ...]] | None:
    """(format, (packed, hbits, scale, min, super)) of a layer on the qblock kernel."""
    method = cast(_QBlockMethod, layer.method)
    if method.lib is None or getattr(layer, "qb_packed", None) is None:
        return None  # a weight the method keeps dense
    if (method.bits, method.group) not in qblock.FORMATS:
        return None
    hbits, minimum = _tensor(layer, "qb_hbits"), _tensor(layer, "qb_min")
    sup = _tensor(layer, "qb_super")
    weights = (
        _tensor(layer, "qb_packed"),
        hbits if hbits.numel() else None,
        _tensor(layer, "qb_scale"),
        minimum if minimum.numel() else None,  # null: a symmetric weight
        sup if sup.numel() else None,  # null: float16 scales
    )
    return decode_stack.qblock_format(method.bits, method.group, method.panels), weights


def _linear_fields(name: str, layer: Linear, bias_allowed: bool) -> tuple[int, Fields] | None:
    """(format, the fields `name`_packed/_hbits/_scale/_min/_super/_format) where the layer
    runs on one of our weight kernels; None otherwise."""
    method = layer.method
    if layer.bias is not None and not bias_allowed:
        return None
    found: tuple[int, tuple[Field, ...]] | None
    if isinstance(method, Int4WeightOnly) and method.lib is not None:
        w4 = tuple(_tensor(layer, w) for w in ("q4_packed", "q4_scale", "q4_min"))
        found = decode_stack.FORMAT_INT4, (w4[0], None, w4[1], w4[2], None)
    elif isinstance(method, Int8WeightOnly) and method.lib is not None:
        # int8 has no minimum: a null pointer
        w8 = (_tensor(layer, "q8_packed"), None, _tensor(layer, "q8_scale"), None, None)
        found = decode_stack.FORMAT_INT8, w8
    elif isinstance(method, BlockQuantized):
        found = _qblock_weights(layer)
    else:
        found = None
    if found is None:
        return None
    fmt, weights = found
    names = [f"{name}_{field}" for field in ("packed", "hbits", "scale", "min", "super")]
    fields: Fields = dict(zip(names, weights, strict=True))
    fields[f"{name}_format"] = fmt
    lora = layer.lora  # its adapter slots, where LoRA is on (sluice/layers/lora.py)
    fields[f"{name}_lora_a"] = None if lora is None else lora.a
    fields[f"{name}_lora_bt"] = None if lora is None else lora.bt
    fields[f"{name}_lora_ranks"] = None if lora is None else lora.ranks
    fields[f"{name}_lora_scale"] = None if lora is None else lora.u_scale  # None: not int8
    return fmt, fields


def _expert_fields(name: str, w: object) -> tuple[int, Fields] | None:
    """(format, the fields `name`_packed.._format) of an expert stack kept in qblock
    layouts; None for dense experts or a format the kernel lacks."""
    if not isinstance(w, QuantizedTensor) or (w.bits, w.group) not in qblock.FORMATS:
        return None
    parts = w.parts()
    if not all(t.is_contiguous() for t in parts if t.numel()):
        return None
    names = [f"{name}_{field}" for field in ("packed", "hbits", "scale", "min", "super")]
    fields: Fields = {n: t if t.numel() else None for n, t in zip(names, parts, strict=True)}
    fmt = decode_stack.qblock_format(w.bits, w.group, w.panels)
    fields[f"{name}_format"] = fmt
    for part in ("a", "bt", "ranks", "scale"):  # experts are not adapted
        fields[f"{name}_lora_{part}"] = None
    return fmt, fields


def _mlp_fields(mlp: MLP | SparseMoE) -> tuple[list[tuple[int, Fields] | None], Fields] | None:
    """(the gate_up and down weights' (format, fields), the MLP's other fields)."""
    if isinstance(mlp, MLP):
        linears = [
            _linear_fields("gate_up", mlp.gate_up_proj, bias_allowed=False),
            _linear_fields("down", mlp.down_proj, bias_allowed=False),
        ]
        moe_parts = ("router", "expert_tokens", "router_bias", "gate_up_bias", "down_bias")
        return linears, dict.fromkeys(moe_parts)
    experts = mlp.experts
    if mlp.shared_expert is not None or experts.lib is None:
        return None
    stacks = [
        _expert_fields("gate_up", experts.gate_up_weight),
        _expert_fields("down", experts.down_weight),
    ]
    fields: Fields = {
        "router": mlp.router.contiguous(),
        "expert_tokens": experts.tokens,
        "router_bias": mlp.router_bias,  # gpt-oss's, fp32; and its experts' biases
        "gate_up_bias": experts.gate_up_bias,
        "down_bias": experts.down_bias,
    }
    return stacks, fields


def layer_fields(
    layer: DecoderLayer, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[set[int], Fields] | None:
    """(the formats of its linears, the layer's fields by name) where every part of the
    layer runs on our kernels in `dtype`; None otherwise."""
    attn = layer.self_attn
    mlp = _mlp_fields(layer.mlp)
    if mlp is None:
        return None
    linears = [
        _linear_fields("qkv", attn.qkv_proj, bias_allowed=True),
        _linear_fields("o", attn.o_proj, bias_allowed=True),
        *mlp[0],
    ]
    qk = (attn.q_norm, attn.k_norm)
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    norms += [n.weight for n in qk if n is not None]
    found = [f for f in linears if f is not None]
    if len(found) < len(linears):
        return None
    # The pools hold the activations' type, or int8 rows (one byte tensor, every layer).
    if any(w.dtype != dtype for w in norms) or k_cache.dtype not in (dtype, torch.uint8):
        return None
    # Biases in the activations' type (the router's is fp32, as its weight).
    biases = [attn.qkv_proj.bias, attn.o_proj.bias, mlp[1]["gate_up_bias"], mlp[1]["down_bias"]]
    if any(isinstance(b, torch.Tensor) and b.dtype != dtype for b in biases):
        return None
    fields: Fields = {
        "input_norm": norms[0],
        "qkv_bias": biases[0],
        "o_bias": biases[1],
        "q_norm": None if qk[0] is None else qk[0].weight,
        "k_norm": None if qk[1] is None else qk[1].weight,
        "sinks": attn.sinks,  # fp32 [heads] (gpt-oss), as the paged kernel reads them
        "window": attn.window or 0,
        "post_norm": norms[1],
        "k_cache": k_cache,
        "v_cache": v_cache,
        **mlp[1],
    }
    for _, linear in found:
        fields.update(linear)
    return {fmt for fmt, _ in found}, fields


def _linears(layer: DecoderLayer) -> list[Linear]:
    """The layer's linears the stack runs (its MLP's where it is dense)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.qkv_proj, attn.o_proj]
    if isinstance(mlp, MLP):
        linears += [mlp.gate_up_proj, mlp.down_proj]
    return linears


def _max_rows_eager(layer: DecoderLayer) -> int:
    """The most rows a step may have for the layer's eager forward to run our weight
    kernels throughout (each linear's, and the experts', dense crossover less one)."""
    mlp = layer.mlp
    # layer_fields returned fields, so every linear runs one of our kernels.
    rows = [cast(_KernelMethod, linear.method).dense_min_rows - 1 for linear in _linears(layer)]
    if isinstance(mlp, SparseMoE):
        # An expert gets at most one pair of each row: fewer rows than the experts'
        # crossover keep every expert on the grouped kernel, as eager runs them.
        rows.append(DENSE_MIN_ROWS.get(kernels.variant(), 4) - 1)
    return min(rows)


def _gemm_min_rows(layer: DecoderLayer) -> int:
    """The row count from which every linear of the layer, and each of its experts by
    its own rows, takes the int8 GEMM in eager (block_quant.GEMM_MIN_ROWS); 0 where some
    weight does not or their counts differ."""
    mlp = layer.mlp
    rows = set()
    for linear in _linears(layer):
        method = linear.method
        if not isinstance(method, BlockQuantized) or not method.int8_gemm:
            return 0
        rows.add(method.dense_min_rows)
    if isinstance(mlp, SparseMoE):
        experts = mlp.experts
        if not experts.int8_gemm:
            return 0
        rows |= {experts.gate_up_dense_rows, experts.down_dense_rows}
    return rows.pop() if len(rows) == 1 else 0


def _max_rows(
    lib: Library, model: LlamaForCausalLM, formats: set[int], max_rows_eager: int
) -> tuple[int, int]:
    """(the most rows a step the stack takes, StackShape.gemm_min_rows). Where every
    layer takes the int8 GEMM from one row count, STACK_GEMM_MAX_ROWS: the stack runs
    the GEMM from there as eager does. Otherwise, on qblock weights, at most the rows one
    pass of its kernel serves (qblock.row_block: 12 at AVX-512, 4 below) below every
    eager crossover; else 3, the decode regime the int4 and int8 kernels (a weight read
    per row) are for. (A cap of 3 for every format once answered a "stall" on 4-15-row
    steps that only tests/test_server.py's queue-full test showed; that test's client
    had closed its stream, a race fixed since.)"""
    gemm_rows = {_gemm_min_rows(layer) for layer in model.layers}
    gemm_min_rows = gemm_rows.pop() if len(gemm_rows) == 1 else 0
    if gemm_min_rows:
        return STACK_GEMM_MAX_ROWS, gemm_min_rows
    limit = qblock.row_block(lib) if formats <= QBLOCK_FORMATS else STACK_MAX_ROWS
    return min(limit, max_rows_eager), 0


def _qk_norm_mode(c: ModelConfig) -> int:
    if not c.qk_norm:
        return decode_stack.QK_NORM_NONE
    if c.qk_norm_per_head:
        return decode_stack.QK_NORM_PER_HEAD
    return decode_stack.QK_NORM_WHOLE


def _lora_rank(model: LlamaForCausalLM) -> int:
    """The rank per slice of the model's LoRA slots (0: LoRA is off)."""
    slots = model.layers[0].self_attn.qkv_proj.lora if model.layers else None
    return 0 if slots is None else slots.rank


class LlamaDecodeStack:
    """Callable as `stack(input_ids, positions, meta) -> hidden` (the model's forward)."""

    def __init__(
        self,
        lib: Library,
        model: LlamaForCausalLM,
        formats: frozenset[int],
        table: decode_stack.LayerTable,
        max_rows: int,
        block_size: int,
        kv_int8: bool,
        gemm_min_rows: int,
    ) -> None:
        self.lib = lib
        self.formats = formats  # of the linears' weights (decode_stack.FORMAT_*, qblock's)
        self.model = model
        self.table = table  # every layer's pointers; it holds the tensors they point to
        self.max_rows = max_rows
        c = model.config
        self.shape = decode_stack.StackShape(
            layers=c.num_layers,
            hidden=c.hidden_size,
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            inter=c.intermediate_size,
            block_size=block_size,
            eps=c.rms_norm_eps,
            scale=c.head_dim**-0.5 if c.attention_scale is None else c.attention_scale,
            kv_int8=kv_int8,
            qk_norm=_qk_norm_mode(c),
            experts=c.num_experts,
            top_k=c.num_experts_per_tok,
            moe_inter=c.moe_intermediate_size,
            renormalize=c.norm_topk_prob,
            softmax_after_top_k=c.softmax_after_top_k,
            swiglu_alpha=c.swiglu_alpha,
            swiglu_limit=0.0 if c.swiglu_limit is None else c.swiglu_limit,
            lora_rank=_lora_rank(model),
            residual_scale=c.residual_multiplier,
            gemm_min_rows=gemm_min_rows,
            gemm_tiles=kernels.tiles(lib),
        )

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> LlamaDecodeStack | None:
        """The stack for this model, or None where some part is not on our kernels."""
        lib = kernels.load()
        # Llama's own layer only (Gemma's norms and GeGLU are not in the stack). Each
        # layer's window, sinks and biases are fields of its row (gpt-oss, Mistral).
        if lib is None or type(model) is not LlamaForCausalLM:
            return None
        c = model.config
        dtype = model.embed_tokens.weight.dtype
        if (
            getattr(backend, "kernel", None) is None
            or model.embed_tokens.weight.device.type != "cpu"
            or dtype not in (torch.float32, torch.bfloat16)
            or max(c.hidden_size, c.num_heads * c.head_dim) > fused_kernels.max_dim(lib)
        ):
            return None
        rows: list[Fields] = []
        formats: set[int] = set()
        max_rows_eager = 1 << 30  # below every linear's dense crossover
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            found = layer_fields(layer, k_cache, v_cache, dtype)
            if found is None:
                return None
            formats |= found[0]
            rows.append(found[1])
            max_rows_eager = min(max_rows_eager, _max_rows_eager(layer))
        max_rows, gemm_min_rows = _max_rows(lib, model, formats, max_rows_eager)
        if max_rows < 1:
            return None
        block_size = kv_caches[0][0].shape[2]  # pools are [blocks, kv_heads, block_size, d]
        table = decode_stack.LayerTable(lib, rows)  # in the library's field order
        kv_dtypes = {k.dtype for k, _ in kv_caches}
        if len(kv_dtypes) != 1:  # one pool format for the whole stack
            return None
        kv_int8 = kv_dtypes == {torch.uint8}
        return cls(
            lib, model, frozenset(formats), table, max_rows, block_size, kv_int8, gemm_min_rows
        )

    def accepts(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Steps whose tokens all go to the paged kernel and our weight-only kernels (and
        that the eager model would run through exactly those kernels)."""
        return 0 < num_tokens <= self.max_rows and meta.num_small_tokens == num_tokens

    @property
    def has_lora(self) -> bool:
        """Whether the model's LoRA slots are in the table (steps with adapters run here)."""
        return self.shape.lora_rank > 0

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        model = self.model
        assert model.rotary is not None, "call init_rotary() first"
        assert meta.small_block_tables is not None and meta.small_query_start is not None
        assert meta.small_ctx_end is not None
        cos, sin = (t.contiguous() for t in model.rotary.lookup(positions))
        h = model.embed(input_ids)  # written in place with the stack's output
        return decode_stack.decode_stack(
            self.lib,
            self.table,
            self.shape,
            h,
            cos,
            sin,
            meta.slot_mapping,
            meta.small_block_tables,
            meta.small_query_start,
            meta.small_ctx_end,
            lora_slots,
        )
