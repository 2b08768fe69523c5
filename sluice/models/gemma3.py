"""Gemma 3 (text): the Llama decoder with Gemma's differences, as subclasses.

What differs from Llama: four norms per layer (each sublayer's output is normalised
before it joins the residual stream), RMSNorm scaling by (1 + weight) (the weights are
stored as offsets from 1; we add the 1 at load and keep the plain x * weight norm),
GeGLU (gelu, tanh approximation) instead of SwiGLU, the embedding scaled by
sqrt(hidden_size), QK-norm, attention scores scaled by query_pre_attn_scalar, and
local layers (a sliding window, their own rope base) interleaved with global ones.
The attention module, the weight loading and the quantized layers are Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.config import ModelConfig
from sluice.core.quantized_tensor import Weight
from sluice.layers import fused
from sluice.layers.rotary import RotaryEmbedding
from sluice.models.checkpoint import Checkpoint
from sluice.models.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from sluice.models.mlp import MLP


class GeGLU(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(fused.gelu_tanh_and_mul(self.gate_up_proj(x)))
        return out


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.mlp = GeGLU(config.hidden_size, config.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normalised MLP output, the residual stream before it), as
        Llama's layer: each residual add fuses into the norm after it."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin))
        x, residual = self.pre_feedforward_layernorm.add_forward(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    hidden_acts = ("gelu_pytorch_tanh", "gelu_tanh")
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.local_rotary: RotaryEmbedding | None = None

    def init_rotary(self, max_positions: int) -> None:
        """Global layers: rope_theta and rope_scaling; local ones their own base, unscaled."""
        super().init_rotary(max_positions)
        c = self.config
        weight = self.embed_tokens.weight
        self.local_rotary = RotaryEmbedding(
            c.head_dim,
            max_positions,
            c.rope_theta if c.rope_local_theta is None else c.rope_local_theta,
            None,
            weight.dtype,
            weight.device,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.rotary is not None and self.local_rotary is not None, "init_rotary() first"
        global_rope = self.rotary.lookup(positions)
        local_rope = self.local_rotary.lookup(positions)
        h = self.embed_tokens(input_ids)
        # transformers multiplies by the scale cast to the weights' dtype; so do we.
        h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype, device=h.device)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            cos, sin = local_rope if layer.self_attn.window is not None else global_rope
            h, residual = layer(h, residual, cos, sin)
        out: torch.Tensor = h if residual is None else h + residual
        return out

    def _load_layer(self, ck: Checkpoint, layer: DecoderLayer, p: str) -> None:
        super()._load_layer(ck, layer, p)
        assert isinstance(layer, Gemma3DecoderLayer)
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            self._put_norm(ck, getattr(layer, name), f"{p}{name}.weight")

    def _norm_scale(self, ck: Checkpoint, stored: Weight) -> Weight:
        """Gemma's checkpoints store each norm's scale minus 1 (HF convention; the GGUF
        loader converts llama.cpp's stored scale to it, as transformers does). The sum
        is taken in fp32, as transformers computes 1 + weight."""
        return ck.dense_float(stored) + 1.0
