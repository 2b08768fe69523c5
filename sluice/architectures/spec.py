"""What an architecture family declares (`ArchitectureSpec`), and what the families share.

The loaders read every model the same Llama-style way (sluice/loader/gguf_loader.py's
`config_from_gguf`, sluice/loader/hf_loader.py's `config_from_hf`); a spec only says
where its family differs: the names it goes by, the ModelConfig fields its files
leave out or spell their own way, its GGUF tensor names, the fix-ups llama.cpp's
converter made to its weights, the decoder class that runs it and what the engine
may ask of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from sluice.config import ModelConfig
from sluice.core.choices import Architecture
from sluice.core.quantized_tensor import Weight

# ModelConfig's keyword arguments, as a reader collects them.
Fields = dict[str, Any]


class MetadataSource(Protocol):
    """A GGUF file's key/value metadata (sluice/loader/gguf_metadata.py's GGUFMetadata)."""

    def get(self, key: str, default: Any = None) -> Any: ...


@dataclass(frozen=True)
class GGUFKeys:
    """A GGUF file's metadata under its architecture's prefix: in a file whose
    general.architecture is "llama", `keys.get("block_count")` reads llama.block_count."""

    meta: MetadataSource
    prefix: str

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.prefix}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata {self.prefix}.{key} is missing")
        return value


# A family's ModelConfig fields from a GGUF: the file's keys and what the shared reading
# found (num_layers, head_dim, ...); the result overrides or adds to the latter.
GGUFFields = Callable[[GGUFKeys, Mapping[str, Any]], Fields]
# A family's ModelConfig fields from a config.json: its contents and the HF class name
# it loads as (config["architectures"][0]); the result overrides the shared reading.
HFFields = Callable[[Mapping[str, Any], str], Fields]
# A weight as a GGUF stores it -> as the HF checkpoint has it: (HF name, weight, config).
WeightTransform = Callable[[str, Weight, ModelConfig], Weight]
# A checkpoint's tensor (HF name, weight, config) -> the tensors it stands for (a fused
# projection's parts under their own names; most tensors: itself).
WeightSplit = Callable[[str, Weight, ModelConfig], dict[str, Weight]]


def no_fields(*_: object) -> Fields:
    """The shared reading is the whole reading."""
    return {}


def as_stored(name: str, weight: Weight, config: ModelConfig) -> Weight:
    """The GGUF stores the weight as the HF checkpoint does."""
    return weight


def unfused(name: str, weight: Weight, config: ModelConfig) -> dict[str, Weight]:
    """Every tensor stands for itself."""
    return {name: weight}


# llama.cpp's per-layer tensor names (blk.N.<name>.weight) and the HF ones
# (model.layers.N.<name>.weight) of a Llama-style layer.
LAYER_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
)
# A Mixture-of-Experts layer's tensors: the router, each projection of every expert
# stacked into one tensor ([experts, out, in]), and Qwen2-MoE's shared expert and its gate.
MOE_LAYER_NAMES: Mapping[str, str] = MappingProxyType(
    {
        **LAYER_NAMES,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    }
)
# Outside the layers, every family's the same.
GLOBAL_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True, eq=False)
class ArchitectureSpec:
    """One architecture family, registered once (sluice/architectures/__init__.py);
    compared and hashed by identity: each family has one."""

    # ModelConfig.architecture: the registry's key, one of core.choices.Architecture.
    name: Architecture
    # How messages name the family ("Gemma 3").
    title: str
    # The decoder class that runs it: a key of sluice.models.MODEL_CLASSES (the
    # classes live above the loader, which must not import them).
    model: str
    # general.architecture values of its GGUF files.
    gguf_names: tuple[str, ...]
    # config.json `architectures` class names of its HF checkpoints.
    hf_classes: tuple[str, ...]
    gguf_fields: GGUFFields = no_fields
    hf_fields: HFFields = no_fields
    # blk.N.<key> -> model.layers.N.<value> (a tensor the table lacks is refused).
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: LAYER_NAMES)
    # Substrings of its HF checkpoints' tensor names -> the shared names (Mixtral's
    # block_sparse_moe.experts.N.w1 -> mlp.experts.N.gate_proj), replaced in order.
    hf_renames: tuple[tuple[str, str], ...] = ()
    # Undoes what llama.cpp's converter did to a weight; the GGUF loader applies it to
    # every tensor of such a file, after renaming.
    gguf_weight: WeightTransform = as_stored
    # Cuts a tensor that holds several projections (Phi-3's qkv_proj and gate_up_proj)
    # into the ones the model loads (q/k/v, gate/up); both loaders apply it, after the
    # renames and transforms above.
    split_weight: WeightSplit = unfused
    # The fused modules split_weight cuts, by their module name (qkv_proj), with the
    # projections they hold: a LoRA adapter trained on one is cut the same way.
    fused_projections: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # What the engine asks: can tensor_parallel_size > 1 split it (sluice/models/
    # tp_shard.py), can an EAGLE head draft for it (speculative_method="eagle").
    tensor_parallel: bool = True
    eagle_head: bool = True
    # An encoder of embedding models (bidirectional, no KV cache): `model` names a
    # class of sluice.models.ENCODER_CLASSES, not a decoder.
    encoder: bool = False

    def hf_tensor_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor of this family, None for one it does not know."""
        if gguf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[gguf_name]
        m = _BLOCK_RE.fullmatch(gguf_name)
        if m is None or m.group(2) not in self.gguf_layer_names:
            return None
        return f"model.layers.{m.group(1)}.{self.gguf_layer_names[m.group(2)]}.{m.group(3)}"

    def hf_checkpoint_name(self, name: str) -> str:
        """A tensor's name in an HF checkpoint of this family -> the shared name."""
        for old, new in self.hf_renames:
            name = name.replace(old, new)
        return name


def moe_from_gguf(keys: GGUFKeys, norm_topk_prob: bool) -> Fields:
    """The expert fields of a GGUF (none for a dense model): llama.cpp's keys; the
    top-k renormalization is the family's (`norm_topk_prob`) unless the file says."""
    count = keys.get("expert_count")
    if not count:
        return {}
    used = keys.get("expert_used_count")
    if used is None:
        raise ValueError(f"GGUF metadata {keys.prefix}.expert_used_count is missing")
    # Mixtral's files have no expert size: its experts are the feed-forward size.
    size = keys.get("expert_feed_forward_length") or keys.require("feed_forward_length")
    return {
        "num_experts": int(count),
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(size),
        "norm_topk_prob": bool(keys.get("expert_weights_norm", norm_topk_prob)),
        "shared_expert_intermediate_size": int(keys.get("expert_shared_feed_forward_length") or 0),
    }


def moe_from_hf(cfg: Mapping[str, Any], norm_topk_prob: bool | None = None) -> Fields:
    """The expert fields of a config.json (none for a dense model). norm_topk_prob: the
    family's fixed choice (Mixtral always renormalizes), None to read the config's.
    Layers without experts (decoder_sparse_step > 1, mlp_only_layers) are refused."""
    count = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not count:
        return {}
    step, dense_layers = cfg.get("decoder_sparse_step") or 1, cfg.get("mlp_only_layers") or []
    if step != 1 or dense_layers:
        raise ValueError(
            "Mixture-of-Experts models with dense layers between the expert layers "
            f"(decoder_sparse_step={step}, mlp_only_layers={dense_layers}) are not supported"
        )
    norm = cfg.get("norm_topk_prob", False) if norm_topk_prob is None else norm_topk_prob
    return {
        "num_experts": int(count),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        "norm_topk_prob": bool(norm),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
    }


def rope_from_hf(params: Mapping[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from one config.json rope_parameters / rope_scaling dict."""
    theta = params.get("rope_theta")
    scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    assert scaling is not None
    # Old configs say "type"; the engine reads "rope_type".
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return (None if theta is None else float(theta)), scaling
