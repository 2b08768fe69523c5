"""Granite-MoE (Granite 3.x 1B-A400M and 3B-A800M): Granite's four scalings over a
Mixture-of-Experts MLP in every layer, no shared expert. The router takes the top k of
its logits and a softmax over those k (ModelConfig.softmax_after_top_k). The
checkpoint stores each layer's experts as block_sparse_moe.input_linear [E, 2I, H]
(gate rows, then up) and output_linear [E, H, I], the router as router.layer; llama.cpp
writes input_linear as one ffn_gate_up_exps (its converter today) or as ffn_gate_exps
and ffn_up_exps (older files). A fused one is cut into gate and up per expert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sluice.architectures import granite
from sluice.architectures.spec import (
    MOE_LAYER_NAMES,
    ArchitectureSpec,
    Fields,
    GGUFKeys,
    moe_from_gguf,
    moe_from_hf,
)
from sluice.config import ModelConfig
from sluice.core.quantized_tensor import QuantizedTensor, Weight

_GATE_UP = "mlp.experts.gate_up_proj.weight"


def split_weight(name: str, weight: Weight, config: ModelConfig) -> dict[str, Weight]:
    """The experts' fused gate/up ([E, 2I, H], or [E * 2I, H] in blocks) as gate and up."""
    if not name.endswith(_GATE_UP):
        return {name: weight}
    experts, inter = config.num_experts, config.moe_intermediate_size
    if isinstance(weight, QuantizedTensor):
        fits = weight.shape[0] == experts * 2 * inter
    else:
        fits = weight.dim() == 3 and tuple(weight.shape[:2]) == (experts, 2 * inter)
    if not fits:
        raise ValueError(
            f"{name} has shape {list(weight.shape)}; the config makes {experts} experts of "
            f"2 x {inter} rows"
        )
    prefix = name.removesuffix(_GATE_UP)
    parts: dict[str, Weight] = {}
    for i, part in enumerate(("gate_proj", "up_proj")):
        if isinstance(weight, QuantizedTensor):
            index = torch.arange(experts)[:, None] * 2 * inter + i * inter + torch.arange(inter)
            parts[f"{prefix}mlp.experts.{part}.weight"] = weight.rows(index.flatten())
        else:
            cut = weight[:, i * inter : (i + 1) * inter].contiguous()
            parts[f"{prefix}mlp.experts.{part}.weight"] = cut
    return parts


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    moe = moe_from_gguf(keys, norm_topk_prob=True)
    if moe.get("shared_expert_intermediate_size"):  # its shared expert has no gate
        raise ValueError(
            f"Granite-MoE with a shared expert ({keys.prefix}.expert_shared_feed_forward_length"
            ") is not supported"
        )
    return {**granite.SPEC.gguf_fields(keys, shared), **moe, "softmax_after_top_k": True}


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    if cfg.get("shared_intermediate_size"):
        raise ValueError("Granite-MoE with a shared expert (GraniteMoeShared) is not supported")
    moe = moe_from_hf(cfg, norm_topk_prob=True)
    return {**granite.SPEC.hf_fields(cfg, hf_class), **moe, "softmax_after_top_k": True}


SPEC = ArchitectureSpec(
    name="granitemoe",
    title="Granite-MoE",
    model="llama",
    gguf_names=("granitemoe",),
    hf_classes=("GraniteMoeForCausalLM",),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names={**MOE_LAYER_NAMES, "ffn_gate_up_exps": "mlp.experts.gate_up_proj"},
    hf_renames=(
        (".block_sparse_moe.router.layer.", ".mlp.gate."),
        (".block_sparse_moe.input_linear.", ".mlp.experts.gate_up_proj."),
        (".block_sparse_moe.output_linear.", ".mlp.experts.down_proj."),
    ),
    gguf_weight=granite.SPEC.gguf_weight,
    split_weight=split_weight,
    tensor_parallel=False,
    eagle_head=False,
)
