"""Read a GGUF file: ModelConfig from its metadata, float32 tensors under Hugging Face names.

Dequantizing with numpy takes seconds, so the converted model (config, tensors, tokenizer) is
kept in a warm-start cache under the cache directory, keyed by the file's identity; a second
load just memory-maps a safetensors file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from sluice import settings
from sluice.config import ModelConfig, check_architecture

from .gguf_metadata import GGUFMetadata
from .gguf_tokenizer import tokenizer_from_gguf
from .tokenizer import Tokenizer

# Bump when the cached layout or the conversion changes, so stale caches are never reused.
CACHE_FORMAT = 2  # 2: entries record the source weight bits (source.json)

_LAYER_NAMES = {
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
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def config_from_gguf(meta: GGUFMetadata, name: str = "model") -> ModelConfig:
    name_in_file = meta.get("general.architecture")
    if name_in_file is None:
        raise ValueError("not a model GGUF: general.architecture is missing")
    # Fail before any expensive work, with the same message ModelConfig gives.
    arch = check_architecture(name_in_file)

    def req(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{key} is missing")
        return value

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    tensor_names = {t.name: t for t in meta.reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "GGUF with per-dimension rope frequency factors (rope_freqs.weight, "
            "Llama-3.1 style rope scaling) is not supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else 0
    embd = tensor_names.get("token_embd.weight")
    if embd is not None and int(embd.shape[-1]) != vocab:
        # The embedding defines the logits' width; a padded or short token list must not.
        vocab = int(embd.shape[-1])

    rope_scaling: dict[str, Any] | None = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if scaling_type not in (None, "none") and factor is not None:
        rope_scaling = {"rope_type": str(scaling_type), "factor": float(factor)}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)

    head_count_kv = meta.get(f"{arch}.attention.head_count_kv")
    key_length = meta.get(f"{arch}.attention.key_length")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=int(head_count_kv) if head_count_kv is not None else heads,
        head_dim=int(key_length) if key_length is not None else hidden // heads,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        name=str(meta.get("general.name") or name),
    )


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope -> HF's rotate_half layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def tensors_from_gguf(reader: GGUFReader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, in torch (out, in) order, under HF names."""
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"unexpected tensor {t.name!r} in a {config.architecture} GGUF")
        # GGUF lists dims fastest-first (ne0 = columns); torch wants them reversed.
        shape = tuple(int(d) for d in reversed(t.shape))
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if not arr.flags.writeable:
            arr = arr.copy()  # F32 tensors are views of the read-only file map
        tensor = torch.from_numpy(arr)
        if config.architecture == "llama":
            if name.endswith("q_proj.weight"):
                tensor = _unpermute_rope(tensor, config.num_heads)
            elif name.endswith("k_proj.weight"):
                tensor = _unpermute_rope(tensor, config.num_kv_heads)
        out[name] = tensor.contiguous()
    return out


# Bits per weight of GGUF quantized types, rounded up to what our methods keep: 2-4 bit
# types to int4, 5-8 bit types to int8 (never fewer bits than the file had).
_TYPE_BITS = {"Q2_K": 4, "Q3_K": 4, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4}
_TYPE_BITS |= {"Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8, "Q8_0": 8, "Q8_1": 8, "Q8_K": 8}


def weight_bits(reader: GGUFReader) -> int | None:
    """4 or 8 when the file's decoder linear weights are mostly quantized to that many
    bits or fewer, None when they are floats."""
    counts: dict[int | None, int] = {}
    for t in reader.tensors:
        m = _BLOCK_RE.fullmatch(t.name)
        if m is None or m.group(3) != "weight" or "norm" in m.group(2):
            continue
        bits = _TYPE_BITS.get(t.tensor_type.name)
        counts[bits] = counts.get(bits, 0) + 1
    return max(counts, key=lambda b: counts[b]) if counts else None


def _cache_entry(path: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}"
    return settings.cache_dir() / "weights" / hashlib.sha256(key.encode()).hexdigest()[:24]


GGUFModel = tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, int | None]


def _read_cache(entry: Path) -> GGUFModel | None:
    try:
        config = ModelConfig(**json.loads((entry / "config.json").read_text()))
        bits = json.loads((entry / "source.json").read_text())["weight_bits"]
        tokenizer = Tokenizer.load(entry)
        tensors = load_file(entry / "model.safetensors")
    except Exception:
        # A corrupt or foreign entry is rebuilt rather than failing the load.
        return None
    return config, tensors, tokenizer, bits


def _write_cache(
    entry: Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    bits: int | None,
) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temp dir and rename it into place: a crash or a concurrent loader never
    # leaves a half-written entry behind.
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        save_file(tensors, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        (tmp / "source.json").write_text(json.dumps({"weight_bits": bits}))
        tokenizer.save(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            pass  # another process won the race; its entry is identical
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(path: str | os.PathLike[str], use_cache: bool | None = None) -> GGUFModel:
    """Config, float32 HF-named tensors, tokenizer and the source's weight bits (see
    weight_bits) of a GGUF model (cached after the first call unless use_cache is False
    or $SLUICE_WEIGHT_CACHE=0)."""
    path = Path(path)
    use_cache = settings.weight_cache_enabled() if use_cache is None else use_cache
    entry = _cache_entry(path) if use_cache else None
    if entry is not None and entry.is_dir():
        cached = _read_cache(entry)
        if cached is not None:
            return cached
        shutil.rmtree(entry, ignore_errors=True)

    meta = GGUFMetadata.of(path)
    config = config_from_gguf(meta, name=path.stem)
    tokenizer = tokenizer_from_gguf(meta)
    tensors = tensors_from_gguf(meta.reader, config)
    bits = weight_bits(meta.reader)
    if entry is not None:
        try:
            _write_cache(entry, config, tensors, tokenizer, bits)
        except OSError:
            pass  # a read-only or full disk costs speed next time, not correctness
    return config, tensors, tokenizer, bits
