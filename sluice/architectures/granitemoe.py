"""Granite-MoE (Granite 3.x 1B-A400M and 3B-A800M) and GraniteMoeShared: Granite's four
scalings over a Mixture-of-Experts MLP in every layer, in GraniteMoeShared with a shared
expert beside the routed ones whose output is added ungated (Qwen2-MoE gates its own).
The router takes the top k of its logits and a softmax over those k
(ModelConfig.softmax_after_top_k). The checkpoint stores each layer's experts as
block_sparse_moe.input_linear [E, 2I, H] (gate rows, then up) and output_linear [E, H, I],
the router as router.layer, the shared expert as shared_mlp.input_linear [2S, H] (gate,
then up) and output_linear [H, S]; llama.cpp writes input_linear as one
ffn_gate_up_exps (its converter today) or as ffn_gate_exps and ffn_up_exps (older
files), and the shared expert as ffn_gate_shexp, ffn_up_shexp and ffn_down_shexp. A
fused gate/up is cut into gate and up (per expert for the routed ones)."""

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
_SHARED_GATE_UP = "mlp.shared_expert.gate_up_proj.weight"


def split_weight(name: str, weight: Weight, config: ModelConfig) -> dict[str, Weight]:
    """The experts' fused gate/up ([E, 2I, H], or [E * 2I, H] in blocks) and the shared
    expert's ([2S, H]) as gate and up."""
    if name.endswith(_SHARED_GATE_UP):
        return _split_shared(name, weight, config)
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


def _split_shared(name: str, weight: Weight, config: ModelConfig) -> dict[str, Weight]:
    """GraniteMoeShared's shared_mlp.input_linear [2S, H] as its gate rows, then up."""
    size = config.shared_expert_intermediate_size
    if len(weight.shape) != 2 or weight.shape[0] != 2 * size:
        raise ValueError(
            f"{name} has shape {list(weight.shape)}; the config makes a shared expert of "
            f"2 x {size} rows"
        )
    prefix = name.removesuffix(_SHARED_GATE_UP)
    parts: dict[str, Weight] = {}
    for i, part in enumerate(("gate_proj", "up_proj")):
        rows = slice(i * size, (i + 1) * size)
        if isinstance(weight, QuantizedTensor):
            cut: Weight = weight.row_slice(rows.start, rows.stop)
        else:
            cut = weight[rows].contiguous()
        parts[f"{prefix}mlp.shared_expert.{part}.weight"] = cut
    return parts


# The shared expert, where there is one, is added as it is (no sigmoid gate).
_UNGATED = {"softmax_after_top_k": True, "shared_expert_gated": False}


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    moe = moe_from_gguf(keys, norm_topk_prob=True)
    return {**granite.SPEC.gguf_fields(keys, shared), **moe, **_UNGATED}


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    moe = moe_from_hf(cfg, norm_topk_prob=True)
    if moe:  # GraniteMoeShared names its shared expert's size its own way
        moe["shared_expert_intermediate_size"] = int(cfg.get("shared_intermediate_size") or 0)
    return {**granite.SPEC.hf_fields(cfg, hf_class), **moe, **_UNGATED}


SPEC = ArchitectureSpec(
    name="granitemoe",
    title="Granite-MoE",
    model="llama",
    gguf_names=("granitemoe",),
    hf_classes=("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names={**MOE_LAYER_NAMES, "ffn_gate_up_exps": "mlp.experts.gate_up_proj"},
    hf_renames=(
        (".block_sparse_moe.router.layer.", ".mlp.gate."),
        (".block_sparse_moe.input_linear.", ".mlp.experts.gate_up_proj."),
        (".block_sparse_moe.output_linear.", ".mlp.experts.down_proj."),
        (".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj."),
        (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."),
    ),
    gguf_weight=granite.SPEC.gguf_weight,
    split_weight=split_weight,
    tensor_parallel=False,
    eagle_head=False,
)
