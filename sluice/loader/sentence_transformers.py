"""Read a sentence-transformers folder's pipeline: what follows the transformer.

`modules.json` lists the modules in order: the Transformer (the folder itself), then
Pooling (its config says mean, CLS or last token), any Dense projections (a config and
a safetensors file each) and Normalize. sentence-transformers runs exactly that
pipeline, so reading it is how our vectors come out equal to its own. A model folder
without `modules.json` (an encoder, or a decoder asked to embed) pools as vLLM's
pooling runner does: CLS for BERT-like encoders, the last token for a decoder,
normalized either way.

These files are untrusted input: each value is checked for its type and range and a
defect names the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from sluice.config import DenseLayer, ModelConfig, PoolerConfig
from sluice.core.choices import PoolingMode
from sluice.core.errors import ModelFileError

from .hf_loader import read_json

_MODULE = "sentence_transformers.models."
# Pooling config keys -> our modes (the other modes of sentence-transformers are refused).
_MODES: dict[str, PoolingMode] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}
# Where the dense layers' weights go among a model's tensors (`sentence_dense.N.weight`):
# apart from a BERT checkpoint's own `pooler.` tensors, which no pipeline uses.
DENSE_PREFIX = "sentence_dense."
# The most Dense layers a pipeline may list (EmbeddingGemma has two).
_MAX_DENSE = 8


def is_sentence_transformers(directory: Path) -> bool:
    return (directory / "modules.json").is_file()


def _modules(directory: Path) -> list[tuple[str, str]]:
    """(type without the package prefix, path) of each module in order."""
    path = directory / "modules.json"
    try:
        listed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFileError(str(path), f"not valid JSON: {exc}") from None
    if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
        raise ModelFileError(str(path), "must hold a list of module objects")
    out = []
    for m in listed:
        kind, where = m.get("type"), m.get("path", "")
        if not isinstance(kind, str) or not isinstance(where, str):
            raise ModelFileError(str(path), f"module {m!r} needs a string type and path")
        if ".." in Path(where).parts or Path(where).is_absolute():
            raise ModelFileError(str(path), f"module path {where!r} leaves the model folder")
        out.append((kind.removeprefix(_MODULE), where))
    return out


def _pooling_mode(path: Path) -> PoolingMode:
    cfg = read_json(path)
    chosen = [mode for key, mode in _MODES.items() if cfg.get(key) is True]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(chosen) != 1 or len(others) != 1:
        raise ModelFileError(
            str(path),
            f"pooling modes {others or 'none'} are not supported: exactly one of "
            f"{', '.join(_MODES)} must be true",
        )
    return chosen[0]


def _dense_layer(directory: Path) -> DenseLayer:
    path = directory / "config.json"
    cfg = read_json(path)
    fields = {k: cfg.get(k) for k in ("in_features", "out_features")}
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 16:
            raise ModelFileError(str(path), f"{key} must be a positive integer, got {value!r}")
    act = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
    if act not in _ACTIVATIONS:
        raise ModelFileError(str(path), f"activation_function {act!r} is not supported")
    return DenseLayer(
        int(cfg["in_features"]),
        int(cfg["out_features"]),
        bool(cfg.get("bias", True)),
        _ACTIVATIONS[act],
    )


def _dense_weights(directory: Path, index: int, layer: DenseLayer) -> dict[str, torch.Tensor]:
    path = directory / "model.safetensors"
    try:
        stored = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelFileError(str(path), f"not a valid safetensors file: {exc}") from None
    want: dict[str, tuple[int, ...]] = {"linear.weight": (layer.out_features, layer.in_features)}
    if layer.bias:
        want["linear.bias"] = (layer.out_features,)
    out = {}
    for name, shape in want.items():
        tensor = stored.get(name)
        if tensor is None or tuple(tensor.shape) != shape or not tensor.is_floating_point():
            found = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
            raise ModelFileError(
                str(path), f"{name} must be a float tensor of {shape}, found {found}"
            )
        out[f"{DENSE_PREFIX}{index}.{name.removeprefix('linear.')}"] = tensor.float()
    return out


def _max_tokens(directory: Path, config: ModelConfig) -> int:
    limit = config.max_position_embeddings - config.position_offset
    path = directory / "sentence_bert_config.json"
    if not path.is_file():
        return limit
    value = read_json(path).get("max_seq_length", limit)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFileError(str(path), f"max_seq_length must be a positive integer, got {value!r}")
    return min(value, limit)


def _extras(directory: Path) -> dict[str, Any]:
    """The prompts and Matryoshka sizes a folder's configs name."""
    path = directory / "config_sentence_transformers.json"
    st = read_json(path) if path.is_file() else {}
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ModelFileError(str(path), "prompts must map names to strings")
    dims = (
        st.get("matryoshka_dimensions")
        or read_json(directory / "config.json").get("matryoshka_dimensions")
        or []
    )
    if not isinstance(dims, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims
    ):
        raise ModelFileError(str(directory), "matryoshka_dimensions must be positive integers")
    return {"prompts": tuple(sorted(prompts.items())), "matryoshka_dimensions": tuple(dims)}


def read_pooler(
    directory: Path, config: ModelConfig
) -> tuple[PoolerConfig, dict[str, torch.Tensor]]:
    """The pooling pipeline of a model folder and its dense layers' weights
    (`sentence_dense.N.weight`/`.bias`)."""
    if not is_sentence_transformers(directory):
        mode: PoolingMode = "cls" if config.bidirectional else "last"
        limit = config.max_position_embeddings - config.position_offset
        return PoolerConfig(mode, True, config.hidden_size, limit), {}
    modules = _modules(directory)
    kinds = [k for k, _ in modules]
    if not kinds or kinds[0] != "Transformer" or kinds.count("Pooling") != 1:
        raise ModelFileError(
            str(directory / "modules.json"), f"expected a Transformer then one Pooling, got {kinds}"
        )
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Dense", "Normalize"})
    if unknown:
        raise ModelFileError(
            str(directory / "modules.json"), f"modules {unknown} are not supported"
        )
    mode = _pooling_mode(directory / dict(modules)["Pooling"] / "config.json")
    dense: list[DenseLayer] = []
    tensors: dict[str, torch.Tensor] = {}
    width = config.hidden_size
    for kind, where in modules:
        if kind != "Dense":
            continue
        if len(dense) == _MAX_DENSE:
            raise ModelFileError(str(directory / "modules.json"), "too many Dense modules")
        layer = _dense_layer(directory / where)
        if layer.in_features != width:
            raise ModelFileError(
                str(directory / where / "config.json"),
                f"in_features is {layer.in_features}, but the vectors before it have {width}",
            )
        tensors.update(_dense_weights(directory / where, len(dense), layer))
        dense.append(layer)
        width = layer.out_features
    pooler = PoolerConfig(
        mode=mode,
        normalize=kinds[-1] == "Normalize",
        dimension=width,
        max_tokens=_max_tokens(directory, config),
        dense=tuple(dense),
        **_extras(directory),
    )
    bad = [d for d in pooler.matryoshka_dimensions if d > width]
    if bad:
        raise ModelFileError(
            str(directory), f"matryoshka_dimensions {bad} exceed the vector's {width}"
        )
    return pooler, tensors
