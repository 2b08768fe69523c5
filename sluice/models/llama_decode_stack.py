"""The Llama decoder stack in one C++ call, for CPU decode steps of a few tokens.

A 1-token step through the Python model spends about as long in per-op overhead
(Python, ctypes, OpenMP fork/join for each of ~300 kernel calls) as in arithmetic.
`sluice_decode_stack` (sluice/kernels/csrc/decode_stack.cpp) runs all layers inside
one parallel region with the same kernels, so it returns exactly what the model's
forward would. It applies where every one of those kernels is ours: CPU, int4 or int8
weights on our kernels, the paged attention kernel, no QK-norm; and to steps whose every
token is a short-chunk query with at most as many rows as our int4 kernel takes.
Anything else goes through the model as usual.
"""

from __future__ import annotations

import ctypes

import torch

from sluice import kernels
from sluice.attention.backend import AttentionBackend, AttentionMetadata
from sluice.layers.linear import Linear
from sluice.layers.quantization import Int4WeightOnly, Int8WeightOnly
from sluice.models.llama import LlamaForCausalLM


def _linear_fields(layer: Linear, bias_allowed: bool) -> tuple[int, list[int]] | None:
    """(weight bits, the kernel's three pointers) where the layer runs on our int4 or
    int8 kernel; None otherwise."""
    method = layer.method
    if layer.bias is not None and not bias_allowed:
        return None
    if isinstance(method, Int4WeightOnly) and method.lib is not None:
        return 4, [layer.q4_packed.data_ptr(), layer.q4_scale.data_ptr(), layer.q4_min.data_ptr()]
    if isinstance(method, Int8WeightOnly) and method.lib is not None:
        return 8, [layer.q8_packed.data_ptr(), layer.q8_scale.data_ptr(), 0]
    return None


class LlamaDecodeStack:
    """Callable as `stack(input_ids, positions, meta) -> hidden` (the model's forward)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        model: LlamaForCausalLM,
        bits: int,
        fields: torch.Tensor,
        max_rows: int,
        block_size: int,
    ) -> None:
        self.lib = lib
        self.bits = bits  # of every linear's weights: 4 or 8
        self.model = model
        self.fields = fields  # [layers, F] int64 pointers; the tensors they point to live in model
        self.max_rows = max_rows
        self.block_size = block_size
        c = model.config
        self.shape = (
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
        )
        self.eps = ctypes.c_float(c.rms_norm_eps)
        self.scale = ctypes.c_float(c.head_dim**-0.5)

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> LlamaDecodeStack | None:
        """The stack for this model, or None where some part is not on our kernels."""
        lib = kernels.load()
        if lib is None or not isinstance(model, LlamaForCausalLM):
            return None
        num_fields = lib.sluice_decode_stack_fields()
        c = model.config
        dtype = model.embed_tokens.weight.dtype
        if (
            num_fields == 0
            or c.qk_norm
            or getattr(backend, "kernel", None) is None
            or model.embed_tokens.weight.device.type != "cpu"
            or dtype not in (torch.float32, torch.bfloat16)
            or c.hidden_size > lib.sluice_fused_max_dim()
        ):
            return None
        rows: list[list[int]] = []
        bits: set[int] = set()
        max_rows = 1 << 30
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [
                _linear_fields(attn.qkv_proj, bias_allowed=True),
                _linear_fields(attn.o_proj, bias_allowed=False),
                _linear_fields(mlp.gate_up_proj, bias_allowed=False),
                _linear_fields(mlp.down_proj, bias_allowed=False),
            ]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            found = [f for f in linears if f is not None]
            if len(found) < len(linears):
                return None
            bits |= {b for b, _ in found}
            qkv, o, gate_up, down = (ptrs for _, ptrs in found)
            if any(w.dtype != dtype for w in norms) or k_cache.dtype != dtype:
                return None
            bias = attn.qkv_proj.bias
            if bias is not None and bias.dtype != dtype:
                return None
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                max_rows = min(max_rows, linear.method.dense_min_rows - 1)
            rows.append(
                [
                    norms[0].data_ptr(),
                    *qkv,
                    0 if bias is None else bias.data_ptr(),
                    *o,
                    norms[1].data_ptr(),
                    *gate_up,
                    *down,
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                ]
            )
        if max_rows < 1 or len(bits) != 1 or any(len(r) != num_fields for r in rows):
            return None  # one weight format throughout: the stack takes one `bits`
        block_size = kv_caches[0][0].shape[2]  # pools are [blocks, kv_heads, block_size, d]
        fields = torch.tensor(rows, dtype=torch.int64)
        return cls(lib, model, bits.pop(), fields, max_rows, block_size)

    def accepts(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Steps whose tokens all go to the paged kernel and our weight-only kernels (and
        that the eager model would run through exactly those kernels)."""
        return 0 < num_tokens <= self.max_rows and meta.num_small_tokens == num_tokens

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        model = self.model
        assert model.rotary is not None, "call init_rotary() first"
        assert meta.small_block_tables is not None and meta.small_query_start is not None
        assert meta.small_ctx_end is not None
        cos, sin = (t.contiguous() for t in model.rotary.lookup(positions))
        h = model.embed_tokens(input_ids)  # written in place with the stack's output
        tables = meta.small_block_tables
        self.lib.sluice_decode_stack(
            int(h.dtype == torch.bfloat16),
            self.bits,
            self.fields.data_ptr(),
            *self.shape,
            self.block_size,
            self.eps,
            self.scale,
            h.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            input_ids.shape[0],
            meta.slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            meta.small_query_start.data_ptr(),
            meta.small_ctx_end.data_ptr(),
            tables.shape[0],
        )
        return h
