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
    "MistralForCausalLM": "llama",  # Mistral is Llama when it has no sliding window
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def config_from_hf(cfg: dict[str, Any], name: str = "model") -> ModelConfig:
    """ModelConfig from the contents of a config.json."""
    archs = cfg.get("architectures") or []
    hf_arch = archs[0] if archs else cfg.get("model_type", "?")
    if hf_arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {hf_arch!r}; sluice supports: "
            f"{', '.join(_ARCHITECTURES)}"
        )
    if hf_arch == "MistralForCausalLM" and cfg.get("sliding_window") is not None:
        raise ValueError(
            "Mistral with sliding-window attention is not supported "
            f"(sliding_window={cfg['sliding_window']})"
        )
    arch = _ARCHITECTURES[hf_arch]
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    # transformers 5 moved rope_theta/rope_scaling into rope_parameters; accept both spellings.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        # Old configs say "type"; the engine reads "rope_type".
        if "rope_type" not in rope_scaling and "type" in rope_scaling:
            rope_scaling["rope_type"] = rope_scaling.pop("type")
        if rope_scaling.get("rope_type") == "default":
            rope_scaling = None
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
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        qk_norm=arch == "qwen3",
        hidden_act=str(cfg.get("hidden_act", "silu")),
        name=name,
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
