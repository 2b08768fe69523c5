"""A Mixture-of-Experts MLP: a router picks k of E expert MLPs for each token.

Routing is the reference's (transformers' Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE
blocks): router logits, a softmax over all experts in fp32, the top k (torch.topk's
order for ties), renormalized to sum to 1 where the model says. A step's (token,
expert) pairs are then sorted by expert (stably: tokens in order within an expert)
into groups, so each chosen expert runs once over all its rows and reads its weights
once a step; experts nobody chose are never read. Each projection of all experts is
one stacked weight (sluice/layers/experts.py): a GGUF's blocks as stored, or a dense
[E, out, in] tensor. The weighted outputs are summed back per token in expert order,
as the reference adds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.config import ModelConfig
from sluice.kernels import fused as fused_kernels
from sluice.layers import fused
from sluice.layers.experts import ExpertGroups, Experts
from sluice.layers.linear import Linear
from sluice.models.checkpoint import Checkpoint
from sluice.models.mlp import MLP

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """The MLP of a Mixture-of-Experts layer (and Qwen2-MoE's gated shared expert)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        # The router in fp32 whatever the model's dtype: its logits pick the experts, and
        # a bf16 matmul would move near-ties (it is E x hidden, a small read).
        self.router = nn.Parameter(
            torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32),
            requires_grad=False,
        )
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(config.hidden_size, shared) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        groups = ExpertGroups.of(ids, self.experts.num_experts)
        tokens = groups.order // self.top_k  # the token of each sorted pair
        h = fused.silu_and_mul(self.experts.gate_up(x[tokens], groups))
        y = self.experts.down(h, groups)
        y = y * weights.flatten()[groups.order].to(y.dtype)[:, None]
        out = torch.zeros_like(x).index_add_(0, tokens, y)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            scale = torch.sigmoid(self.shared_expert_gate(x))
            out = out + scale * self.shared_expert(x)
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of x's rows. Experts on our kernels
        route with our kernel, which the one-call decode stack
        (sluice/models/llama_decode_stack.py) shares: its steps then pick and weigh the
        experts exactly as this layer does."""
        lib, k = self.experts.lib, self.top_k
        if lib is not None and x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES:
            return fused_kernels.moe_route(lib, x.contiguous(), self.router, k, self.renormalize)
        return route(F.linear(x.float(), self.router), self.top_k, self.renormalize)

    def held(self) -> list[torch.Tensor]:
        """The router (for weight_bytes; the experts and shared expert count themselves)."""
        return [self.router]

    def load(self, ck: Checkpoint, prefix: str, keep_quantized: bool) -> None:
        """This layer's router, experts and shared expert (`prefix`: "model.layers.N.mlp.");
        keep_quantized: experts a GGUF stores in blocks stay in them."""
        router = ck.dense_float(ck.take(prefix + "gate.weight"))
        if tuple(router.shape) != tuple(self.router.shape):
            raise ValueError(
                f"{prefix}gate.weight has shape {tuple(router.shape)}, "
                f"expected {tuple(self.router.shape)}"
            )
        self.router.copy_(router)
        self.experts.load(
            ck.take(prefix + "experts.gate_proj.weight"),
            ck.take(prefix + "experts.up_proj.weight"),
            ck.take(prefix + "experts.down_proj.weight"),
            dtype=ck.dtype,
            keep_quantized=keep_quantized,
        )
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            p = prefix + "shared_expert."
            shared = self.shared_expert
            ck.put_linear(shared.gate_up_proj, [p + "gate_proj.weight", p + "up_proj.weight"])
            ck.put_linear(shared.down_proj, [p + "down_proj.weight"])
            # llama.cpp stores the shared expert's gate as a vector [hidden].
            gate = ck.dense(ck.take(prefix + "shared_expert_gate.weight"))
            ck.put(self.shared_expert_gate.weight, gate.reshape(1, -1))
