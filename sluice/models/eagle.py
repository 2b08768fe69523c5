"""A self-drafting head (EAGLE-style): one decoder layer that runs on the target's own
hidden states and predicts its next one.

The target's feature at position i (its final-normed hidden state, the vector its
output head reads) already holds most of what decides token i + 1. The head takes that
feature and the embedding of the token that followed, fc(cat(embed(t[i+1]), f[i])),
runs one decoder layer of the target's shape with a paged KV of its own, and
normalises: its output is a guess of f[i+1], which the target's (restricted) output
head turns into a draft of t[i+2]; fed back with that draft, it guesses f[i+2], and so
on. One layer and part of the head cost a fraction of a target step, and the guesses
are the target's own thinking continued, not a second model's.

`EagleHead` is the serving side (a LlamaForCausalLM of one layer, so it runs on a
ModelRunner and its paged attention; the embedding and output head are the target's
weights, loaded from the target's file); `train_forward` is the same computation in
plain differentiable torch over whole sequences (training/train_eagle.py), on the same
parameter names. tests/test_eagle.py checks that the two agree.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from sluice.config import ModelConfig
from sluice.core.quantized_tensor import Weight
from sluice.layers.linear import Linear
from sluice.layers.rotary import _inv_freq
from sluice.models.checkpoint import Checkpoint
from sluice.models.llama import LlamaForCausalLM

# The head's own tensors, by the names its file stores (bf16 or fp32 safetensors); the
# embedding and output head come from the target's file.
EAGLE_TENSORS = (
    "fc.weight",
    *(f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkvo"),
    *(f"model.layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight",
)


def eagle_config(target: ModelConfig) -> ModelConfig:
    """The head's shape: one decoder layer of the target's."""
    return dataclasses.replace(target, num_layers=1, name=f"{target.name} (EAGLE head)")


class EagleHead(LlamaForCausalLM):
    """One decoder layer over fc(cat(embed(token), feature)). forward needs the
    features of its rows (ModelRunner passes StepInputs.features); compute_logits and
    the final norm are Llama's, so `norm(forward(...))` is the next feature."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.fc = Linear(2 * config.hidden_size, config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm. features [T, hidden]: the
        target's (or the head's own guessed) feature at the position before each
        token; None is zeros (the start-up cost measurement times a pass, nothing
        more)."""
        assert self.rotary is not None, "call init_rotary() first"
        cos, sin = self.rotary.lookup(positions)
        e = self.embed_tokens(input_ids)
        if features is None:
            features = torch.zeros_like(e)
        h = self.fc(torch.cat([e, features.to(e.dtype)], dim=-1))
        out, residual = self.layers[0](h, None, cos, sin)
        guess: torch.Tensor = out + residual
        return guess

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, Weight]) -> None:
        """The head's tensors (EAGLE_TENSORS) and the target's embedding and output
        head (model.embed_tokens.weight, lm_head.weight where untied)."""
        Checkpoint(tensors, self.embed_tokens.weight.dtype).put_linear(self.fc, ["fc.weight"])
        super().load_weights(tensors)


def train_forward(
    params: dict[str, torch.Tensor],
    config: ModelConfig,
    embeds: torch.Tensor,
    features: torch.Tensor,
) -> torch.Tensor:
    """EagleHead's computation over whole sequences, differentiable: embeds and
    features [B, L, hidden] (row i: the embedding of t[i+1], the feature f[i]) ->
    the guessed next features [B, L, hidden], final-normed. `params` holds EAGLE_TENSORS
    (fp32, trainable); attention is causal within each sequence."""
    c = config
    p = "model.layers.0."
    b, n, _ = embeds.shape
    h = torch.cat([embeds, features], dim=-1) @ params["fc.weight"].T
    x = _rms(h, params[p + "input_layernorm.weight"], c.rms_norm_eps)
    q = (x @ params[p + "self_attn.q_proj.weight"].T).view(b, n, c.num_heads, c.head_dim)
    k = (x @ params[p + "self_attn.k_proj.weight"].T).view(b, n, c.num_kv_heads, c.head_dim)
    v = (x @ params[p + "self_attn.v_proj.weight"].T).view(b, n, c.num_kv_heads, c.head_dim)
    cos, sin = _rotary_tables(c, n, x.device)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    att = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    att = att.transpose(1, 2).reshape(b, n, c.num_heads * c.head_dim)
    h = h + att @ params[p + "self_attn.o_proj.weight"].T
    x = _rms(h, params[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
    gate = x @ params[p + "mlp.gate_proj.weight"].T
    up = x @ params[p + "mlp.up_proj.weight"].T
    h = h + (F.silu(gate) * up) @ params[p + "mlp.down_proj.weight"].T
    return _rms(h, params["model.norm.weight"], c.rms_norm_eps)


def init_params(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fresh fp32 parameters for training: small random projections, unit norms."""
    c = config
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (c.hidden_size, 2 * c.hidden_size),
        "model.layers.0.self_attn.q_proj.weight": (c.num_heads * c.head_dim, c.hidden_size),
        "model.layers.0.self_attn.k_proj.weight": (c.num_kv_heads * c.head_dim, c.hidden_size),
        "model.layers.0.self_attn.v_proj.weight": (c.num_kv_heads * c.head_dim, c.hidden_size),
        "model.layers.0.self_attn.o_proj.weight": (c.hidden_size, c.num_heads * c.head_dim),
        "model.layers.0.mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "model.layers.0.mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "model.layers.0.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    params = {
        name: torch.randn(shape, generator=g) * (0.02 if "fc" not in name else 0.01)
        for name, shape in shapes.items()
    }
    for name in EAGLE_TENSORS:
        if name.endswith("norm.weight"):
            params[name] = torch.ones(c.hidden_size)
    return params


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotary_tables(c: ModelConfig, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    inv = _inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, n).float()
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv).to(device)
    return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The half-split (NeoX) rotation, as layers.rotary and layers.fused apply it."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
