"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a Mixture-of-Experts decoder whose attention has
a learned sink logit per head (it joins every softmax's denominator as a key with no
value) and biases on q, k, v and the output projection, alternating a 128-token
sliding window (even layers) with full attention (odd ones), YaRN rope; its router has
a bias and takes the top k of its logits, then a softmax over those k; each expert's
projections have biases and its activation is a clamped SwiGLU (ModelConfig's
swiglu_limit).

The HF checkpoint stores the experts as gate_up_proj [E, H, 2I] (in, out order, gate
and up interleaved column by column) and down_proj [E, I, H], with biases beside them
(gate_up_proj_bias [E, 2I], interleaved too); llama.cpp's converter writes them as
ffn_gate_exps / ffn_up_exps / ffn_down_exps and their .bias tensors, the router as
ffn_gate_inp, the sinks as attn_sinks and the second norm as post_attention_norm.
The released checkpoints keep the experts in MXFP4 (`*_blocks` / `*_scales`, rows out
by in): the loader reads each pair as one weight of 4-bit codes (loader/hf_mxfp4.py),
cut here into the gate, up and down stacks as the dense ones are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

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

# What every gpt-oss has that its files do not say (llama.cpp fixes the same values).
_FIXED: Fields = {
    "attention_bias": True,
    "o_proj_bias": True,
    "attention_sinks": True,
    "moe_bias": True,
    "softmax_after_top_k": True,
    "swiglu_alpha": 1.702,
}
_EXPERTS = ".mlp.experts."


def _windows(num_layers: int, layer_types: list[str] | None) -> tuple[int, ...]:
    """The sliding-window layers: as config.json's layer_types lists them, else every
    even layer (the released models' pattern, and llama.cpp's for these files)."""
    if layer_types is None:
        return tuple(range(0, num_layers, 2))
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers; the model has {num_layers}")
    return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    layers = int(shared["num_layers"])
    rope = dict(shared.get("rope_scaling") or {})
    if rope.get("rope_type") == "yarn":
        rope["truncate"] = False  # the model's own YaRN (transformers'; llama.cpp floors)
    window = keys.get("attention.sliding_window")
    return {
        **_FIXED,
        **moe_from_gguf(keys, norm_topk_prob=True),
        "sliding_window": int(window) if window else None,
        "sliding_window_layers": _windows(layers, None) if window else None,
        "rope_scaling": rope or None,
        "swiglu_limit": 7.0,
    }


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    bias = bool(cfg.get("attention_bias", True))
    window = cfg.get("sliding_window")
    layers = int(cfg["num_hidden_layers"])
    return {
        **_FIXED,
        **moe_from_hf(cfg, norm_topk_prob=True),
        "attention_bias": bias,
        "o_proj_bias": bias,
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
        "sliding_window": int(window) if window else None,
        "sliding_window_layers": _windows(layers, cfg.get("layer_types")) if window else None,
    }


def split_weight(name: str, weight: Weight, config: ModelConfig) -> dict[str, Weight]:
    """The HF checkpoint's expert tensors as the model loads them: gate_up_proj [E, H, 2I]
    -> gate_proj and up_proj [E, I, H] (its even and odd columns), down_proj [E, I, H]
    -> [E, H, I], and their biases likewise (GGUF files have them split already)."""
    prefix, sep, part = name.rpartition(_EXPERTS)
    if not sep or "." in part:
        return {name: weight}
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    if isinstance(weight, QuantizedTensor):
        return _split_quantized(prefix + _EXPERTS, part, weight, (e, i, h))
    expected = {
        "gate_up_proj": (e, h, 2 * i),
        "gate_up_proj_bias": (e, 2 * i),
        "down_proj": (e, i, h),
        "down_proj_bias": (e, h),
    }
    if part not in expected:
        return {name: weight}
    if tuple(weight.shape) != expected[part]:
        raise ValueError(
            f"{name} has shape {list(weight.shape)}; the config's {e} experts of {i} units "
            f"(hidden size {h}) need {list(expected[part])}"
        )
    p = prefix + _EXPERTS
    if part == "gate_up_proj":
        rows = weight.transpose(1, 2)  # [E, 2I, H]
        return {
            p + "gate_proj.weight": rows[:, 0::2].contiguous(),
            p + "up_proj.weight": rows[:, 1::2].contiguous(),
        }
    if part == "gate_up_proj_bias":
        return {
            p + "gate_proj.bias": weight[:, 0::2].contiguous(),
            p + "up_proj.bias": weight[:, 1::2].contiguous(),
        }
    if part == "down_proj":
        return {p + "down_proj.weight": weight.transpose(1, 2).contiguous()}
    return {p + "down_proj.bias": weight}


def _split_quantized(
    p: str, part: str, weight: QuantizedTensor, sizes: tuple[int, int, int]
) -> dict[str, Weight]:
    """The released checkpoint's MXFP4 experts (loader/hf_mxfp4.py), rows already out
    by in: gate_up_proj [E * 2I, H], gate and up alternating rows; down_proj [E * H, I]."""
    e, i, h = sizes
    expected = {"gate_up_proj": (e * 2 * i, h), "down_proj": (e * h, i)}
    if part not in expected:
        raise ValueError(f"{p}{part}: MXFP4 blocks where gpt-oss has none")
    if weight.shape != expected[part]:
        raise ValueError(
            f"{p}{part}_blocks holds {weight.shape[0]} rows of {weight.shape[1]} values; "
            f"the config's {e} experts of {i} units (hidden size {h}) need "
            f"{expected[part][0]} rows of {expected[part][1]}"
        )
    if part == "down_proj":
        return {p + "down_proj.weight": weight}
    gate_rows = torch.arange(0, e * 2 * i, 2)
    return {
        p + "gate_proj.weight": weight.rows(gate_rows),
        p + "up_proj.weight": weight.rows(gate_rows + 1),
    }


SPEC = ArchitectureSpec(
    name="gpt_oss",
    title="gpt-oss",
    model="llama",
    gguf_names=("gpt-oss",),
    hf_classes=("GptOssForCausalLM",),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names={
        **MOE_LAYER_NAMES,
        "attn_sinks": "self_attn.sinks",
        "post_attention_norm": "post_attention_layernorm",
    },
    hf_renames=((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.sinks.weight")),
    split_weight=split_weight,
    eagle_head=False,
)
