"""The Llama decoder stack in one C++ call, for CPU decode steps of a few tokens.

A 1-token step through the Python model spends about as long in per-op overhead
(Python, ctypes, OpenMP fork/join for each of ~300 kernel calls) as in arithmetic.
`sluice_decode_stack` (sluice/kernels/csrc/decode_stack.cpp) runs all layers inside
one parallel region with the same kernels, so it returns exactly what the model's
forward would. It applies where every one of those kernels is ours: CPU, int4 weights
on our int4 kernel, the paged attention kernel, no QK-norm; and to steps whose every
token is a short-chunk query with at most as many rows as our int4 kernel takes.
Anything else goes through the model as usual.
"""

from __future__ import annotations

import ctypes

import torch

from sluice import kernels
from sluice.attention.backend import AttentionBackend, AttentionMetadata
from sluice.layers.linear import Linear
from sluice.layers.quantization import Int4WeightOnly
from sluice.models.llama import LlamaForCausalLM


def _int4_fields(layer: Linear, bias_allowed: bool) -> list[int] | None:
    method = layer.method
    if not isinstance(method, Int4WeightOnly) or method.lib is None:
        return None
    if layer.bias is not None and not bias_allowed:
        return None
    return [layer.q4_packed.data_ptr(), layer.q4_scale.data_ptr(), layer.q4_min.data_ptr()]


class LlamaDecodeStack:
    """Callable as `stack(input_ids, positions, meta) -> hidden` (the model's forward)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        model: LlamaForCausalLM,
        fields: torch.Tensor,
        max_rows: int,
        block_size: int,
    ) -> None:
        self.lib = lib
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
        max_rows = 1 << 30
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _int4_fields(attn.qkv_proj, bias_allowed=True)
            o = _int4_fields(attn.o_proj, bias_allowed=False)
            gate_up = _int4_fields(mlp.gate_up_proj, bias_allowed=False)
            down = _int4_fields(mlp.down_proj, bias_allowed=False)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if qkv is None or o is None or gate_up is None or down is None:
                return None
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
        if max_rows < 1 or any(len(r) != num_fields for r in rows):
            return None
        block_size = kv_caches[0][0].shape[2]  # pools are [blocks, kv_heads, block_size, d]
        return cls(lib, model, torch.tensor(rows, dtype=torch.int64), max_rows, block_size)

    def accepts(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Steps whose tokens all go to the paged kernel and our int4 kernel (and that
        the eager model would run through exactly those kernels)."""
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
