"""Read a Hugging Face model directory: config.json, *.safetensors shards, tokenizer files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from sluice.config import ModelConfig
from sluice.core.choices import Architecture

from .tokenizer import Tokenizer

# Hugging Face class names and the decoder family (ModelConfig.architecture) each loads as.
_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # Llama with a sliding window (config.sliding_window)
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}


def _rope(params: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from one rope_parameters / rope_scaling dict."""
    theta = params.get("rope_theta")
    scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    assert scaling is not None
    # Old configs say "type"; the engine reads "rope_type".
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return (None if theta is None else float(theta)), scaling


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 3 config adds: which layers are local, their rope, the scalings.
    Defaults are transformers' Gemma3TextConfig's."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(
            "attn_logit_softcapping is not supported "
            f"(attn_logit_softcapping={cfg['attn_logit_softcapping']})"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (causal LM only)")
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", 6))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    params = cfg.get("rope_parameters") or {}
    global_theta, scaling = _rope(params.get("full_attention") or {})
    if cfg.get("rope_scaling") is not None:
        scaling = _rope(dict(cfg["rope_scaling"]))[1]
    local_theta = _rope(params.get("sliding_attention") or {})[0]
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        sliding_window=int(cfg.get("sliding_window") or 4096),
        sliding_window_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        rope_theta=global_theta or float(cfg.get("rope_theta", 1_000_000.0)),
        rope_scaling=scaling,
        rope_local_theta=local_theta or float(cfg.get("rope_local_base_freq", 10_000.0)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        hidden_act=str(cfg.get("hidden_activation", "gelu_pytorch_tanh")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
    )


def config_from_hf(cfg: dict[str, Any], name: str = "model") -> ModelConfig:
    """ModelConfig from the contents of a config.json."""
    archs = cfg.get("architectures") or []
    hf_arch = archs[0] if archs else cfg.get("model_type", "?")
    if hf_arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {hf_arch!r}; sluice supports: "
            f"{', '.join(_ARCHITECTURES)}"
        )
    arch = _ARCHITECTURES[hf_arch]
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    # transformers 5 moved rope_theta/rope_scaling into rope_parameters; accept both spellings.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = _rope(dict(cfg.get("rope_scaling") or rope_params))[1]
    fields: dict[str, Any] = dict(
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3",
        hidden_act=str(cfg.get("hidden_act", "silu")),
    )
    if hf_arch == "MistralForCausalLM" and cfg.get("sliding_window") is not None:
        fields["sliding_window"] = int(cfg["sliding_window"])  # every layer
    if arch == "gemma3":
        fields.update(_gemma3_fields(cfg))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        name=name,
        **fields,
    )


def tensors_from_hf_dir(directory: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(shard).items():
            tensors[name] = tensor.float()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # same layout as a GGUF: tied means no lm_head
    return tensors


def load_hf_dir(
    path: str | os.PathLike[str],
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    directory = Path(path)
    cfg = json.loads((directory / "config.json").read_text())
    config = config_from_hf(cfg, name=directory.name)
    tokenizer = Tokenizer.from_hf_dir(directory)
    return config, tensors_from_hf_dir(directory, config), tokenizer
