"""Read a GGUF file: ModelConfig from its metadata, weights under Hugging Face names.

Quantized weights stay quantized: each tensor is read once and repacked into the block
layout our kernels read (sluice/loader/gguf_blocks.py), so memory stays close to the
file's size and no float copy exists, in RAM or on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from sluice import settings
from sluice.architectures import GGUFKeys, spec_for_gguf, spec_of
from sluice.config import ModelConfig
from sluice.core.errors import ModelFileError
from sluice.core.quantized_tensor import Weight

from . import gguf_blocks
from .gguf_check import GGUFTensor
from .gguf_metadata import GGUFMetadata
from .gguf_tokenizer import tokenizer_from_gguf
from .tokenizer import Tokenizer

logger = logging.getLogger("sluice")


def config_from_gguf(meta: GGUFMetadata, name: str = "model") -> ModelConfig:
    """ModelConfig from a GGUF's metadata: the Llama-style keys every family shares,
    then what its family (sluice/architectures/) reads or fixes on top."""
    name_in_file = meta.get("general.architecture")
    if name_in_file is None:
        raise ValueError("not a model GGUF: general.architecture is missing")
    # Fail before any expensive work, naming what sluice supports.
    spec = spec_for_gguf(name_in_file)
    keys = GGUFKeys(meta, str(name_in_file))
    hidden = int(keys.require("embedding_length"))
    heads = int(keys.require("attention.head_count"))
    tensor_names = meta.tensor_named
    head_count_kv = keys.get("attention.head_count_kv")
    key_length = keys.get("attention.key_length")
    head_dim = int(key_length) if key_length is not None else hidden // heads
    # Rope may turn only part of each head (Phi-4-mini: 96 of 128 dims).
    rotary_dim = int(keys.get("rope.dimension_count", head_dim))
    fields: dict[str, Any] = dict(
        vocab_size=_vocab_size(meta, tensor_names),
        hidden_size=hidden,
        intermediate_size=int(keys.require("feed_forward_length")),
        num_layers=int(keys.require("block_count")),
        num_heads=heads,
        num_kv_heads=int(head_count_kv) if head_count_kv is not None else heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        rms_norm_eps=float(keys.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(keys.get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_freq_factors(meta, rotary_dim)
        or _longrope(keys, meta, rotary_dim)
        or _rope_scaling(keys),
        max_position_embeddings=int(keys.get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        name=str(meta.get("general.name") or name),
    )
    fields.update(spec.gguf_fields(keys, fields))
    return ModelConfig(architecture=spec.name, **fields)


def _vocab_size(meta: GGUFMetadata, tensor_names: dict[str, GGUFTensor]) -> int:
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else 0
    embd = tensor_names.get("token_embd.weight")
    if embd is not None and int(embd.shape[-1]) != vocab:
        # The embedding defines the logits' width; a padded or short token list must not.
        vocab = int(embd.shape[-1])
    return vocab


# Llama 3's rope scaling as llama.cpp's converter writes it (_rope_freq_factors).
ROPE_FREQS = "rope_freqs.weight"


def _rope_freq_factors(meta: GGUFMetadata, rotary_dim: int) -> dict[str, Any] | None:
    """Llama 3.x rope scaling as llama.cpp's converter writes it: no scaling keys, but a
    `rope_freqs.weight` tensor of one factor per rotary pair that divides that pair's
    frequency (llama.cpp's freq_factors). The factors are read as stored, so any
    scaling the converter baked in is reproduced exactly."""
    if ROPE_FREQS not in meta.tensor_named:
        return None
    factors = _pair_factors(meta, ROPE_FREQS, rotary_dim)
    return {"rope_type": "freq_factors", "factors": factors}


def _pair_factors(meta: GGUFMetadata, name: str, rotary_dim: int) -> list[float]:
    """A tensor of one rope factor per rotary pair: F32, rotary_dim / 2 finite positive
    values, else an error naming it."""
    tensor = meta.tensor_named[name]
    shape = tuple(int(d) for d in tensor.shape)
    pairs = rotary_dim // 2
    if tensor.tensor_type.name != "F32" or shape != (pairs,):
        raise ValueError(
            f"{name} must be F32 of {pairs} values (one per rotary pair of {rotary_dim} "
            f"rotary dims); the file has {tensor.tensor_type.name} {list(shape)}"
        )
    factors = np.asarray(meta.tensor_data(tensor), dtype=np.float32).reshape(-1)
    if factors.size != pairs or not bool(np.all(np.isfinite(factors) & (factors > 0))):
        raise ValueError(f"{name} holds a factor that is not a finite positive number")
    return [float(f) for f in factors]


# Phi-3's LongRoPE as llama.cpp's converter writes it: a factor per rotary pair for
# short and for long contexts, the trained context and the attention factor as keys.
ROPE_FACTORS = {"short": "rope_factors_short.weight", "long": "rope_factors_long.weight"}


def _longrope(keys: GGUFKeys, meta: GGUFMetadata, rotary_dim: int) -> dict[str, Any] | None:
    """layers/rotary.py's longrope scaling from a GGUF, or None where it has none."""
    tensor_names = meta.tensor_named
    if not any(name in tensor_names for name in ROPE_FACTORS.values()):
        return None
    missing = [n for n in ROPE_FACTORS.values() if n not in tensor_names]
    if missing:
        raise ValueError(f"LongRoPE needs both factor tensors; {missing[0]} is missing")
    original = int(keys.require("rope.scaling.original_context_length"))
    context = int(keys.get("context_length", original))
    return {
        "rope_type": "longrope",
        **{f"{k}_factor": _pair_factors(meta, n, rotary_dim) for k, n in ROPE_FACTORS.items()},
        "original_max_position_embeddings": original,
        "factor": context / original,
        "attention_factor": keys.get("rope.scaling.attn_factor"),
    }


def _rope_scaling(keys: GGUFKeys) -> dict[str, Any] | None:
    scaling_type = keys.get("rope.scaling.type")
    factor = keys.get("rope.scaling.factor")
    if scaling_type in (None, "none") or factor is None:
        return None
    rope_scaling: dict[str, Any] = {"rope_type": str(scaling_type), "factor": float(factor)}
    original = keys.get("rope.scaling.original_context_length")
    if original is not None:
        rope_scaling["original_max_position_embeddings"] = int(original)
    return rope_scaling


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in the file, and what they are."""

    name: str  # the GGUF name (blk.0.attn_q.weight)
    type_name: str  # GGMLQuantizationType name: F32, Q4_K, ...
    shape: tuple[int, ...]  # torch order (out, in)
    offset: int
    nbytes: int
    part: int = 0  # which file of a split set (0 for a single file)


def tensor_entries(meta: GGUFMetadata, part: int = 0) -> list[TensorEntry]:
    # GGUF lists dims fastest-first (ne0 = columns); torch wants them reversed.
    return [
        TensorEntry(
            t.name,
            t.tensor_type.name,
            tuple(int(d) for d in reversed(t.shape)),
            int(t.data_offset),
            int(t.n_bytes),
            part,
        )
        for t in meta.tensors
    ]


_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def gguf_parts(path: Path) -> list[Path]:
    """The files of the model whose first file is `path`: llama.cpp's gguf-split writes
    `name-00001-of-00003.gguf` and on, each a GGUF with some of the tensors (the first
    holds the metadata). A single file is a set of one."""
    m = _SPLIT_NAME.search(path.name)
    if m is None:
        return [path]
    if int(m[1]) != 1:
        raise ModelFileError(str(path), f"is part {int(m[1])} of a split model: load part 1")
    count = int(m[2])
    parts = [
        path.with_name(f"{path.name[: m.start()]}-{i:05d}-of-{count:05d}.gguf")
        for i in range(1, count + 1)
    ]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFileError(str(path), f"the split model's part(s) {missing} are missing")
    return parts


def _read(
    f: io.BufferedReader, entry: TensorEntry, start: int = 0, size: int | None = None
) -> np.ndarray:
    """Bytes start..start+size of a tensor, read from the file into a buffer of their
    own: reading through a memory map would leave every page of the file resident
    (counted in RSS) until the map closes, doubling the peak memory of a load."""
    size = entry.nbytes - start if size is None else size
    buf = np.empty(size, dtype=np.uint8)
    f.seek(entry.offset + start)
    if f.readinto(buf.data) != buf.nbytes:
        raise ValueError(f"GGUF file is truncated in tensor {entry.name!r}")
    return buf


def _to_weight(f: io.BufferedReader, entry: TensorEntry, keep_quantized: bool) -> Weight:
    """Quantized types we have a layout for stay quantized (sluice/loader/gguf_blocks.py),
    read a few MB of rows at a time; floats stay as stored; any other type is
    dequantized to float32."""
    shape, type_name = entry.shape, entry.type_name
    cols = shape[-1]
    rows = int(np.prod(shape[:-1]))
    # A 3-D tensor is a Mixture-of-Experts projection [experts, out, in]: its rows are
    # independent too, kept as one [experts * out, in] weight.
    if keep_quantized and len(shape) in (2, 3) and gguf_blocks.can_keep(type_name, cols):
        row_bytes = entry.nbytes // rows

        def read_rows(r0: int, r1: int) -> torch.Tensor:
            return torch.from_numpy(_read(f, entry, r0 * row_bytes, (r1 - r0) * row_bytes))

        return gguf_blocks.repack(read_rows, type_name, rows, cols)
    buf = _read(f, entry)
    if type_name in _FLOAT_TYPES:
        return torch.from_numpy(buf).view(_FLOAT_TYPES[type_name]).reshape(shape)
    arr = np.asarray(dequantize(buf, GGMLQuantizationType[type_name]), dtype=np.float32)
    return torch.from_numpy(arr.reshape(shape))


# Tensors that hold hyper-parameters, not weights: config_from_gguf reads them.
CONFIG_TENSORS = frozenset({ROPE_FREQS, *ROPE_FACTORS.values()})
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def tensors_from_gguf(
    path: Path, entries: list[TensorEntry], config: ModelConfig, keep_quantized: bool = True
) -> dict[str, Weight]:
    """Every tensor under HF names in torch (out, in) order: quantized ones repacked
    into our layouts (or dequantized to float32 if not keep_quantized), floats as
    stored. `path` is the first file of a split set."""
    out: dict[str, Weight] = {}
    spec = spec_of(config.architecture)
    with contextlib.ExitStack() as files:
        parts = [files.enter_context(open(p, "rb")) for p in gguf_parts(Path(path))]
        for entry in entries:
            f = parts[entry.part]
            if entry.name in CONFIG_TENSORS:  # read into the config (config_from_gguf)
                continue
            name = spec.hf_tensor_name(entry.name)
            if name is None:
                raise ValueError(
                    f"unexpected tensor {entry.name!r} in a {config.architecture} GGUF"
                )
            weight = _to_weight(f, entry, keep_quantized)
            if not keep_quantized and isinstance(weight, torch.Tensor):
                weight = weight.float()
            # What llama.cpp's converter changed (llama's q/k row order, Gemma's norms),
            # and a fused projection cut into its parts (Phi-3's).
            out.update(spec.split_weight(name, spec.gguf_weight(name, weight, config), config))
    return out


def expert_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each Mixture-of-Experts tensor a layer must have (GGUF name after blk.N.) and
    its shape in torch order."""
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "ffn_gate_inp.weight": (e, h),
        "ffn_gate_exps.weight": (e, i, h),
        "ffn_up_exps.weight": (e, i, h),
        "ffn_down_exps.weight": (e, h, i),
    }
    s = config.shared_expert_intermediate_size
    if s:
        shapes.update(
            {
                "ffn_gate_shexp.weight": (s, h),
                "ffn_up_shexp.weight": (s, h),
                "ffn_down_shexp.weight": (h, s),
            }
        )
        if config.shared_expert_gated:
            shapes["ffn_gate_inp_shexp.weight"] = (h,)
    if config.moe_bias:  # gpt-oss: the router's and every expert's biases
        shapes.update(
            {
                "ffn_gate_inp.bias": (e,),
                "ffn_gate_exps.bias": (e, i),
                "ffn_up_exps.bias": (e, i),
                "ffn_down_exps.bias": (e, h),
            }
        )
    return shapes


def check_expert_tensors(config: ModelConfig, entries: list[TensorEntry]) -> None:
    """A Mixture-of-Experts file's expert tensors against its metadata (expert_count,
    expert_feed_forward_length, ...), before any weight is read: a missing router or a
    stack of the wrong count or size is named, not found later as a shape error."""
    if not config.is_moe:
        return
    by_name = {t.name: t for t in entries}
    shapes = expert_shapes(config)
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    for layer in range(config.num_layers):
        layer_shapes = dict(shapes)
        if f"blk.{layer}.ffn_gate_up_exps.weight" in by_name:  # gate and up in one stack
            del layer_shapes["ffn_gate_exps.weight"], layer_shapes["ffn_up_exps.weight"]
            layer_shapes["ffn_gate_up_exps.weight"] = (e, 2 * i, h)
        for suffix, shape in layer_shapes.items():
            name = f"blk.{layer}.{suffix}"
            entry = by_name.get(name)
            if entry is None:
                raise ValueError(f"GGUF Mixture-of-Experts model is missing tensor {name!r}")
            # The shared expert's gate is a vector, or a [1, hidden] matrix.
            if entry.shape != shape and (len(shape) > 1 or entry.shape != (1, *shape)):
                raise ValueError(
                    f"GGUF tensor {name!r} has shape {list(entry.shape)}; the metadata "
                    f"({config.num_experts} experts of {config.moe_intermediate_size} units, "
                    f"hidden size {config.hidden_size}) needs {list(shape)}"
                )


GGUFModel = tuple[ModelConfig, dict[str, Weight], Tokenizer]


def _remove_legacy_cache() -> None:
    """Older versions kept a float32 copy of every GGUF they loaded under
    cache_dir()/weights (4-11x the file); nothing reads it any more."""
    legacy = settings.cache_dir() / "weights"
    if legacy.is_dir():
        size = sum(p.stat().st_size for p in legacy.rglob("*") if p.is_file())
        shutil.rmtree(legacy, ignore_errors=True)
        logger.info("removed the float32 weight cache of older versions (%.1f GB)", size / 1e9)


# Bump when the header cache's layout or the config/tokenizer conversion changes, or
# when files need checking again (4: gguf_check runs before a header is cached; 5: split
# sets, each tensor's part).
HEADER_FORMAT = 5


def _header_entry(path: Path) -> Path:
    key = f"{HEADER_FORMAT}"
    for part in gguf_parts(path):
        st = part.stat()
        key += f"|{part.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return settings.cache_dir() / "gguf-headers" / hashlib.sha256(key.encode()).hexdigest()[:24]


Header = tuple[ModelConfig, Tokenizer, list[TensorEntry]]


def _read_header(path: Path) -> Header:
    parts = gguf_parts(path)
    meta = GGUFMetadata.of(path)
    config = config_from_gguf(meta, name=_SPLIT_NAME.sub("", path.name).removesuffix(".gguf"))
    entries = tensor_entries(meta)
    for i, part in enumerate(parts[1:], start=1):
        entries += tensor_entries(GGUFMetadata.of(part), i)
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ModelFileError(str(path), f"tensor {dup!r} is in two parts of the split model")
    return config, tokenizer_from_gguf(meta), entries


def _cached_header(path: Path) -> Header:
    """The file's config, tokenizer and tensor table. Parsing a GGUF header takes
    seconds (100k+ token strings through numpy), so these (a few MB; never weights)
    are kept under the cache directory, keyed by the file's identity."""
    entry = _header_entry(path)
    try:
        config = ModelConfig(**json.loads((entry / "config.json").read_text()))
        rows = json.loads((entry / "tensors.json").read_text())
        tensors = [TensorEntry(r[0], r[1], tuple(r[2]), r[3], r[4], r[5]) for r in rows]
        return config, Tokenizer.load(entry), tensors
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        pass  # missing or foreign: parse the file (and rewrite the entry)
    config, tokenizer, tensors = header = _read_header(path)
    with contextlib.suppress(OSError):  # read-only disk: slower next time, not wrong
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        rows_out = [
            [t.name, t.type_name, list(t.shape), t.offset, t.nbytes, t.part] for t in tensors
        ]
        (tmp / "tensors.json").write_text(json.dumps(rows_out))
        tokenizer.save(tmp)
        shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)
    return header


def load_gguf_header(path: str | os.PathLike[str]) -> tuple[ModelConfig, Tokenizer]:
    """Config and tokenizer of a GGUF model, without reading its weights."""
    config, tokenizer, _ = _cached_header(Path(path))
    return config, tokenizer


def load_gguf(path: str | os.PathLike[str], keep_quantized: bool = True) -> GGUFModel:
    """Config, HF-named weights (quantized ones in our layouts unless keep_quantized is
    False) and tokenizer of a GGUF model. Weights are read from the file every time:
    repacking runs at disk speed, so no copy of them is cached."""
    path = Path(path)
    _remove_legacy_cache()
    config, tokenizer, entries = _cached_header(path)
    check_expert_tensors(config, entries)
    tensors = tensors_from_gguf(path, entries, config, keep_quantized)
    return config, tensors, tokenizer
