"""Llama-family decoder: Llama 2/3, SmolLM, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm).

It runs on the flat ragged batch of a step: tokens [T], positions [T]. Attention is
reached through the step context (sluice/attention/step.py), which holds the batch
layout and the paged KV cache, so the model's arguments are only tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from sluice.attention.step import attend
from sluice.config import ModelConfig
from sluice.layers import fused
from sluice.layers.linear import Linear
from sluice.layers.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 like the reference implementations, then cast back.
        return fused.rms_norm(x, self.weight, self.eps)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the residual may be updated in place."""
        return fused.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: one weight read, one kernel launch.
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k heads rotate together, in place where fused.
        q, k = fused.rotate(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = attend(q, k, v, self.layer_index)
        projected: torch.Tensor = self.o_proj(out.reshape(t, self.q_size))
        return projected


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter)
        self.down_proj = Linear(self.inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); their sum is the
        layer's output. Carrying the two apart lets each residual add fuse into the
        following RMSNorm."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        x = self.self_attn(x, cos, sin)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        self.config = config
        # _weight skips the random init: load_weights overwrites it anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
            _freeze=True,
        )
        # A ModuleList (it registers the layers), typed as the sequence of DecoderLayers
        # it is: nn.Module's attribute typing would make each item a Tensor | Module.
        self.layers = cast(
            Sequence[DecoderLayer],
            nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers)),
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.rotary: RotaryEmbedding | None = None

    def init_rotary(self, max_positions: int) -> None:
        c = self.config
        self.rotary = RotaryEmbedding(
            c.head_dim,
            max_positions,
            c.rope_theta,
            c.rope_scaling,
            self.embed_tokens.weight.dtype,
            self.embed_tokens.weight.device,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm (inside a step_context)."""
        assert self.rotary is not None, "call init_rotary() first"
        cos, sin = self.rotary.lookup(positions)
        h = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        out: torch.Tensor = h if residual is None else h + residual
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits.float()

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up."""
        c = self.config
        dtype = self.embed_tokens.weight.dtype
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            used.add(name)
            return tensors[name]

        def put(param: torch.Tensor, value: torch.Tensor) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"shape mismatch: expected {tuple(param.shape)}, got {tuple(value.shape)}"
                )
            param.copy_(value.to(dtype))

        put(self.embed_tokens.weight, take("model.embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            att = layer.self_attn
            qkv = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            put(att.qkv_proj.weight, torch.cat(qkv))
            if att.qkv_proj.bias is not None:  # config.attention_bias
                put(
                    att.qkv_proj.bias,
                    torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]),
                )
            put(att.o_proj.weight, take(p + "self_attn.o_proj.weight"))
            if att.q_norm is not None and att.k_norm is not None:
                put(att.q_norm.weight, take(p + "self_attn.q_norm.weight"))
                put(att.k_norm.weight, take(p + "self_attn.k_norm.weight"))
            gate_up = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
            put(layer.mlp.gate_up_proj.weight, torch.cat(gate_up))
            put(layer.mlp.down_proj.weight, take(p + "mlp.down_proj.weight"))
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"))
            put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"))
        put(self.norm.weight, take("model.norm.weight"))
        if c.tie_word_embeddings or "lm_head.weight" not in tensors:
            tied = self.embed_tokens.weight
            assert isinstance(tied, nn.Parameter)
            self.lm_head.weight = tied  # tied: one copy in memory
        else:
            put(self.lm_head.weight, take("lm_head.weight"))
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weight(module)
