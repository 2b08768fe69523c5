"""A Mixture-of-Experts MLP: a router picks k of E expert MLPs for each token.

Routing is the reference's (transformers' Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE
blocks): router logits, a softmax over all experts in fp32, the top k (torch.topk's
order for ties), renormalized to sum to 1 where the model says; Granite-MoE's takes
the top k of the logits first and a softmax over those. With the experts on
our CPU kernels (a GGUF's blocks) the same steps run in one compiled function
(`SparseMoE.route`), which the fused decode stack shares, so a step routes alike
whichever path runs it. A step's (token,
expert) pairs are then sorted by expert (stably: tokens in order within an expert)
into groups, so each chosen expert runs once over all its rows and reads its weights
once a step; experts nobody chose are never read. Each projection of all experts is
one stacked weight (sluice/layers/experts.py): a GGUF's blocks as stored, or a dense
[E, out, in] tensor. The weighted outputs are summed back per token in expert order,
as the reference adds them.
"""

from __future__ import annotations

from collections.abc import Callable

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
from sluice.models.tp_shard import Collectives

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, softmax_after_top_k: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from router logits [T, E]."""
    if softmax_after_top_k:  # Granite-MoE: the k largest logits, a softmax over them
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """The MLP of a Mixture-of-Experts layer, with a shared expert where the model has
    one (Qwen2-MoE's gated, GraniteMoeShared's added as it is)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.softmax_after_top_k = config.softmax_after_top_k
        # The router in fp32 whatever the model's dtype: its logits pick the experts, and
        # a bf16 matmul would move near-ties (it is E x hidden, a small read).
        self.router = nn.Parameter(
            torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32),
            requires_grad=False,
        )
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        # gpt-oss: a bias on the router's logits and on every expert projection, and the
        # clamped SwiGLU as the experts' activation.
        self.router_bias = (
            nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False)
            if config.moe_bias
            else None
        )
        self.swiglu = (
            None if config.swiglu_limit is None else (config.swiglu_alpha, config.swiglu_limit)
        )
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(config.hidden_size, shared) if shared else None
        gated = shared and config.shared_expert_gated
        self.shared_expert_gate = Linear(config.hidden_size, 1) if gated else None
        # Expert parallelism (split_experts): this rank holds experts first_expert ..
        # first_expert + experts.num_experts of the router's, and `reduce` sums the
        # ranks' partial outputs.
        self.first_expert = 0
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.shared_here = True  # the shared expert is added by one rank

    def split_experts(self, tp: Collectives) -> None:
        """Make this layer one rank's part of an expert-parallel group: 1/N of the
        experts (E divisible by N, check_tensor_parallel), every token routed over all
        of them on every rank (the router is replicated), each rank computing its
        experts' share and an all-reduce summing the shares. Call before loading."""
        per_rank = self.router.shape[0] // tp.world_size
        e = self.experts
        self.experts = Experts(per_rank, e.hidden, e.inter)
        self.first_expert = tp.rank * per_rank
        self.reduce = tp.all_reduce
        self.shared_here = tp.rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        local, pairs = self._local_pairs(ids)
        groups = ExpertGroups.of(local, self.experts.num_experts)
        pair = groups.order if pairs is None else pairs[groups.order]
        tokens = pair // self.top_k  # the token of each sorted pair
        h = self._activate(self.experts.gate_up(x[tokens], groups))
        y = self.experts.down(h, groups)
        y = y * weights.flatten()[pair].to(y.dtype)[:, None]
        out = torch.zeros_like(x).index_add_(0, tokens, y)
        if self.shared_expert is not None and self.shared_here:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out if self.reduce is None else self.reduce(out)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' activation of [rows, 2I] (gate, then up): SiLU(gate) * up, or
        gpt-oss's clamped SwiGLU."""
        if self.swiglu is None:
            return fused.silu_and_mul(gate_up)
        return fused.clamped_swiglu(gate_up, *self.swiglu)

    def _local_pairs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this rank's expert of each of its pairs, those pairs' flat indices token * k
        + slot); (ids, None) when this rank holds every expert."""
        if self.reduce is None:
            return ids, None
        local = ids.flatten() - self.first_expert
        pairs = ((local >= 0) & (local < self.experts.num_experts)).nonzero().flatten()
        return local[pairs], pairs

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of x's rows. Experts on our kernels
        route with our kernel, which the one-call decode stack
        (sluice/models/llama_decode_stack.py) shares: its steps then pick and weigh the
        experts exactly as this layer does."""
        lib, k = self.experts.lib, self.top_k
        if lib is not None and x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES:
            return fused_kernels.moe_route(
                lib,
                x.contiguous(),
                self.router,
                k,
                self.renormalize,
                self.router_bias,
                self.softmax_after_top_k,
            )
        logits = F.linear(x.float(), self.router, self.router_bias)
        return route(logits, self.top_k, self.renormalize, self.softmax_after_top_k)

    def held(self) -> list[torch.Tensor]:
        """The router (for weight_bytes; the experts and shared expert count themselves)."""
        held: list[torch.Tensor] = [self.router]
        return held if self.router_bias is None else [*held, self.router_bias]

    def load(
        self, ck: Checkpoint, prefix: str, keep_quantized: bool, int8_prompts: bool = False
    ) -> None:
        """This layer's router, experts and shared expert (`prefix`: "model.layers.N.mlp.");
        keep_quantized: experts a GGUF stores in blocks stay in them; int8_prompts: their
        many-row matmuls take int8 activations (BlockQuantized's)."""
        ck.put_float(self.router, prefix + "gate.weight")
        if self.router_bias is not None:
            ck.put_float(self.router_bias, prefix + "gate.bias")
        self.experts.load(
            ck.take(prefix + "experts.gate_proj.weight"),
            ck.take(prefix + "experts.up_proj.weight"),
            ck.take(prefix + "experts.down_proj.weight"),
            dtype=ck.dtype,
            keep_quantized=keep_quantized,
            int8_prompts=int8_prompts,
        )
        if self.router_bias is not None:  # config.moe_bias: the experts' too
            p = prefix + "experts."
            gate, up, down = (ck.take(f"{p}{n}_proj.bias") for n in ("gate", "up", "down"))
            self.experts.load_biases(gate, up, down, dtype=ck.dtype)
        if self.shared_expert is not None:
            p = prefix + "shared_expert."
            shared = self.shared_expert
            ck.put_linear(shared.gate_up_proj, [p + "gate_proj.weight", p + "up_proj.weight"])
            ck.put_linear(shared.down_proj, [p + "down_proj.weight"])
        if self.shared_expert_gate is not None:
            # llama.cpp stores the shared expert's gate as a vector [hidden].
            gate = ck.dense(ck.take(prefix + "shared_expert_gate.weight"))
            ck.put(self.shared_expert_gate.weight, gate.reshape(1, -1))
