"""Read a Hugging Face model directory: config.json, *.safetensors shards, tokenizer files."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from sluice.architectures import rope_from_hf, spec_for_hf, spec_of
from sluice.config import ModelConfig
from sluice.core.errors import ModelFileError
from sluice.core.quantized_tensor import Weight

from . import hf_mxfp4
from .tokenizer import Tokenizer


def config_from_hf(cfg: dict[str, Any], name: str = "model") -> ModelConfig:
    """ModelConfig from the contents of a config.json: the Llama-style keys every family
    shares, then what its family (sluice/architectures/) reads or fixes on top."""
    archs = cfg.get("architectures") or []
    hf_arch = archs[0] if archs else cfg.get("model_type", "?")
    spec = spec_for_hf(hf_arch)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    # transformers 5 moved rope_theta/rope_scaling into rope_parameters; accept both spellings.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    fields: dict[str, Any] = dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_from_hf(dict(cfg.get("rope_scaling") or rope_params))[1],
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        name=name,
    )
    fields.update(spec.hf_fields(cfg, hf_arch))
    return ModelConfig(architecture=spec.name, **fields)


def _load_shard(shard: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A safetensors file's tensors, one at a time (a shard is gigabytes: read whole, it
    would sit in memory beside everything converted from it); safetensors checks its
    header against the file (lengths, offsets, dtypes) and a defect names the file."""
    try:
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelFileError(str(shard), f"not a valid safetensors file: {exc}") from None


def model_dir_name(directory: Path) -> str:
    """A model directory's name; for a Hub cache snapshot (models--org--repo/snapshots/
    <commit>) the repo's, not the commit's."""
    repo = directory.parent.parent.name
    if directory.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return directory.name


def check_safetensors(path: Path) -> None:
    """A safetensors file's header against the file (lengths, offsets, dtypes), without
    reading its tensors; a defect names the file."""
    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelFileError(str(path), f"not a valid safetensors file: {exc}") from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model's file; a defect names the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFileError(str(path), f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelFileError(str(path), "must hold a JSON object")
    return value


def _checkpoint_weights(shards: list[Path]) -> Iterator[tuple[str, Weight]]:
    """Each weight of the shards under its checkpoint name: floats as float32, MXFP4
    pairs (`X_blocks` and `X_scales`, in any shard) as one weight X kept in its codes
    (hf_mxfp4); a pair missing its other half is named."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for shard in shards:
        for name, tensor in _load_shard(shard):
            base = hf_mxfp4.base_name(name)
            if base is None or tensor.dtype != torch.uint8:
                yield name, tensor.float()
                continue
            pair = pending.setdefault(base, {})
            pair[name.removeprefix(base)] = tensor
            if len(pair) == 2:
                del pending[base]
                yield base, hf_mxfp4.to_weight(base, pair["_blocks"], pair["_scales"])
    for base, pair in pending.items():
        (missing,) = set(hf_mxfp4.SUFFIXES) - set(pair)
        raise ValueError(f"checkpoint has {base}{next(iter(pair))} but no {base}{missing}")


def tensors_from_hf_dir(directory: Path, config: ModelConfig) -> dict[str, Weight]:
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    spec = spec_of(config.architecture)
    tensors: dict[str, Weight] = {}
    for name, weight in _checkpoint_weights(shards):
        tensors.update(spec.split_weight(spec.hf_checkpoint_name(name), weight, config))
    if not spec.encoder and not any(n.startswith("model.") for n in tensors):
        # A bare backbone (transformers' *Model classes: EmbeddingGemma's
        # Gemma3TextModel) saves its layers without the causal LM's "model." prefix.
        tensors = {f"model.{n}": t for n, t in tensors.items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # same layout as a GGUF: tied means no lm_head
    if config.is_moe:
        stack_experts(tensors, config.num_experts)
    return tensors


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+_proj\.weight)")


def stack_experts(tensors: dict[str, Weight], num_experts: int) -> None:
    """Checkpoints store each expert's projections apart (mlp.experts.N.gate_proj); the
    model takes each projection of all experts as one [E, out, in] tensor, as a GGUF
    stores it (mlp.experts.gate_proj). In place; a missing expert is named."""
    found: dict[str, dict[int, torch.Tensor]] = {}
    for name in [n for n in tensors if _EXPERT.fullmatch(n)]:
        m = _EXPERT.fullmatch(name)
        assert m is not None
        weight = tensors.pop(name)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{name}: an expert of its own must be a float tensor")
        found.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = weight
    for name, experts in found.items():
        missing = sorted(set(range(num_experts)) - set(experts))
        if missing or len(experts) != num_experts:
            raise ValueError(
                f"checkpoint has {len(experts)} experts for {name} (config: {num_experts}); "
                f"missing {missing[:8]}"
            )
        tensors[name] = torch.stack([experts[e] for e in range(num_experts)])


def load_hf_dir(
    path: str | os.PathLike[str],
) -> tuple[ModelConfig, dict[str, Weight], Tokenizer]:
    directory = Path(path)
    cfg = read_json(directory / "config.json")
    config = config_from_hf(cfg, name=model_dir_name(directory))
    tokenizer = Tokenizer.from_hf_dir(directory, post_process=config.bidirectional)
    return config, tensors_from_hf_dir(directory, config), tokenizer
