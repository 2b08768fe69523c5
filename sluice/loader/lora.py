"""LoRA adapter files -> a validated `LoRAAdapter`: PEFT folders (adapter_config.json +
adapter_model.safetensors) and llama.cpp's GGUF adapters (general.type = adapter).

Adapters are untrusted input, like model files: the file's size is bounded by what an
adapter of the allowed rank can hold before anything is read, and every tensor's
name, shape, rank and dtype is checked against the base model. A defect raises
`LoRAAdapterError`, which names the adapter, its path and the tensor or key.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from sluice.architectures import spec_of
from sluice.config import ModelConfig
from sluice.core.choices import LORA_MODEL_TARGETS, LORA_TARGETS, LoRATarget
from sluice.core.errors import ModelFileError
from sluice.core.lora import MODEL_LAYER, LoRAAdapter, LoRAModule
from sluice.loader.gguf_metadata import GGUFMetadata
from sluice.loader.hf_loader import check_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MAX_CONFIG_BYTES = 1 << 20
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# PEFT's names: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight; the
# model's own modules base_model.model.lm_head.lora_A.weight and, for the embedding,
# base_model.model.model.embed_tokens.lora_embedding_A (no .weight).
_PEFT_RE = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_PEFT_MODEL_RE = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?()(lm_head|embed_tokens)\.lora_(?:embedding_)?([AB])"
    r"(?:\.weight)?"
)
_PEFT_BASE_COPY_RE = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?(?:lm_head|embed_tokens)\.base_layer\.weight"
)
# llama.cpp's: blk.N.attn_q.weight.lora_a; token_embd.weight.lora_a, output.weight.lora_a.
_GGUF_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
_GGUF_MODEL_RE = re.compile(r"()(token_embd|output)\.weight\.lora_([ab])")
_GGUF_TARGETS: dict[str, LoRATarget] = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
    "token_embd": "embed_tokens",
    "output": "lm_head",
}


class LoRAAdapterError(ModelFileError):
    """A LoRA adapter that is malformed or does not fit the base model."""

    def __init__(self, name: str, path: str, defect: str) -> None:
        super().__init__(path, defect)
        self.args = (f"LoRA adapter {name!r} ({path}): {defect}",)
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type[LoRAAdapterError], tuple[str, str, str]]:  # type: ignore[override]
        return type(self), (self.name, self.path, self.defect)


def target_shape(config: ModelConfig, target: LoRATarget) -> tuple[int, int]:
    """(in, out) of a projection of the base model (the embedding's `in` is the
    vocabulary: a token is its one-hot row)."""
    hidden, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {
        "embed_tokens": (config.vocab_size, hidden),
        "lm_head": (hidden, config.vocab_size),
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[target]


def adaptable_targets(config: ModelConfig) -> tuple[LoRATarget, ...]:
    """What an adapter may adapt on this model: attention, a dense model's MLP (a
    Mixture-of-Experts model's experts are not adapted), the embedding and the head."""
    if config.is_moe:
        return ("q_proj", "k_proj", "v_proj", "o_proj", *LORA_MODEL_TARGETS)
    return (*LORA_TARGETS, *LORA_MODEL_TARGETS)


def max_adapter_bytes(config: ModelConfig, max_rank: int) -> int:
    """The most bytes an adapter of rank <= max_rank can hold for this model (fp32
    every target of every layer, the embedding and the head, and peft's copies of the
    base embedding and head), plus room for headers: a larger file is refused before
    it is read."""
    targets = adaptable_targets(config)
    per_layer = sum(sum(target_shape(config, t)) for t in targets if t in LORA_TARGETS)
    model_level = sum(sum(target_shape(config, t)) for t in LORA_MODEL_TARGETS)
    base_copies = 2 * config.vocab_size * config.hidden_size * 4  # _read_peft_tensors
    low_rank = (per_layer * config.num_layers + model_level) * max_rank * 4
    return low_rank + base_copies + (1 << 20)


@dataclass(frozen=True)
class _Source:
    """What the readers share: the adapter's name, its path, the base and the limits."""

    name: str
    path: Path
    config: ModelConfig
    max_rank: int

    def error(self, defect: str) -> LoRAAdapterError:
        return LoRAAdapterError(self.name, str(self.path), defect)


def load_lora_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` (a PEFT folder or a .gguf file) for base model `config`,
    validated; ranks above `max_rank` are refused."""
    p = Path(path).expanduser()
    src = _Source(name, p, config, max_rank)
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(src)
    if p.is_dir():
        return _load_peft(src)
    raise src.error("not found: give a PEFT adapter folder (adapter_config.json) or a .gguf file")


def _bounded_size(src: _Source, file: Path) -> int:
    if not file.is_file():
        raise src.error(f"{file.name} is missing")
    size = file.stat().st_size
    limit = max_adapter_bytes(src.config, src.max_rank)
    if size > limit:
        raise src.error(
            f"{file.name} is {size:,} bytes, more than an adapter of rank <= {src.max_rank} "
            f"can hold for {src.config.name} ({limit:,}): raise max_lora_rank if its rank is higher"
        )
    return size


def _read_peft_config(src: _Source) -> dict[str, Any]:
    file = src.path / CONFIG_FILE
    if not file.is_file():
        if (src.path / "adapter_model.bin").is_file():
            raise src.error("pickled adapter_model.bin is not loaded: save it as safetensors")
        raise src.error(f"{CONFIG_FILE} is missing: not a PEFT adapter folder")
    if file.stat().st_size > _MAX_CONFIG_BYTES:
        raise src.error(f"{CONFIG_FILE} is larger than {_MAX_CONFIG_BYTES:,} bytes")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise src.error(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise src.error(f"{CONFIG_FILE} must hold a JSON object")
    return cfg


# PEFT options that change what the weights mean; an adapter that sets them is refused
# rather than served wrong.
_UNSUPPORTED = (
    ("use_dora", "DoRA adapters"),
    ("fan_in_fan_out", "fan_in_fan_out weights"),
    ("modules_to_save", "fully trained modules (modules_to_save)"),
    ("rank_pattern", "per-module ranks (rank_pattern)"),
    ("alpha_pattern", "per-module alphas (alpha_pattern)"),
    ("target_parameters", "adapted parameters (target_parameters)"),
    ("lora_bias", "adapters with a bias on B (lora_bias)"),
    ("trainable_token_indices", "trained token embeddings (trainable_token_indices)"),
    ("layer_replication", "replicated layers (layer_replication)"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
    ("use_qalora", "QA-LoRA adapters (use_qalora)"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
)


def _peft_scale(src: _Source, cfg: dict[str, Any]) -> tuple[int, float]:
    """(rank, scale) from a PEFT config: lora_alpha / r, or / sqrt(r) with rsLoRA."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise src.error(f"peft_type {cfg.get('peft_type')!r} is not a LoRA adapter")
    for key, what in _UNSUPPORTED:
        if cfg.get(key):
            raise src.error(f"{what} are not supported ({key} in {CONFIG_FILE})")
    if cfg.get("bias", "none") != "none":
        raise src.error(f"adapters that train biases are not supported (bias={cfg['bias']!r})")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise src.error(f"r must be a positive integer in {CONFIG_FILE}, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise src.error(f"lora_alpha must be a positive number in {CONFIG_FILE}, got {alpha!r}")
    if not math.isfinite(alpha):
        raise src.error(f"lora_alpha must be finite, got {alpha!r}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise src.error(f"use_rslora must be true or false, got {rslora!r}")
    return rank, alpha / (math.sqrt(rank) if rslora else rank)


def _check_targets(src: _Source, cfg: dict[str, Any]) -> None:
    """target_modules, where it is a list, names only projections this model adapts
    (a string is PEFT's regex over module names: the tensors then say what is adapted)."""
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or targets is None:
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise src.error(f"target_modules must be a list of names, got {targets!r}")
    allowed = (*adaptable_targets(src.config), *spec_of(src.config.architecture).fused_projections)
    for t in targets:
        if t.rsplit(".", 1)[-1] not in allowed:
            raise src.error(
                f"target module {t!r} is not supported (supported: {', '.join(allowed)})"
            )


def _load_peft(src: _Source) -> LoRAAdapter:
    cfg = _read_peft_config(src)
    rank, scale = _peft_scale(src, cfg)
    if rank > src.max_rank:
        raise src.error(f"rank {rank} is above max_lora_rank {src.max_rank}")
    _check_targets(src, cfg)
    weights = src.path / WEIGHTS_FILE
    _bounded_size(src, weights)
    tensors = _unfused(src, _read_peft_tensors(src, weights))
    pairs = _pairs(src, tensors, _name_parser(_PEFT_RE, _PEFT_MODEL_RE, {}))
    digest = hashlib.sha256((src.path / CONFIG_FILE).read_bytes())
    digest.update(weights.read_bytes())
    ranks: dict[LoRATarget, int] = {t: rank for t in (*LORA_TARGETS, *LORA_MODEL_TARGETS)}
    return _adapter(src, pairs, ranks, scale, digest)


def _read_peft_tensors(src: _Source, weights: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors, less the copies of the base embedding and head that peft
    saves beside their adapters (save_embedding_layers): frozen in LoRA training, so
    the base model's own, which are not read; one of another shape means a resized
    vocabulary, which the base model does not have."""
    try:
        check_safetensors(weights)
        from safetensors import safe_open

        tensors = {}
        with safe_open(weights, "pt") as f:
            for name in f.keys():
                if _PEFT_BASE_COPY_RE.fullmatch(name):
                    shape = list(f.get_slice(name).get_shape())
                    base = [src.config.vocab_size, src.config.hidden_size]
                    if shape != base:
                        raise src.error(
                            f"tensor {name} has shape {shape}; the base model's is {base} "
                            "(trained with a resized vocabulary?)"
                        )
                    continue
                tensors[name] = f.get_tensor(name)
        return tensors
    except LoRAAdapterError:
        raise
    except (ModelFileError, OSError, ValueError) as exc:
        raise src.error(f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}") from None


def _fused_parts(
    src: _Source, name: str, module: str, which: str, t: torch.Tensor
) -> dict[str, torch.Tensor]:
    """LoRA tensor `name` (its A or B: `which`) of fused module `module` (the base
    weight's name without ".weight": ...layers.N.self_attn.qkv_proj) as one per
    projection the module holds, by projection (q_proj): the same A, B's rows cut as the
    base weight is (the architecture's split_weight), so the products are the same."""
    spec = spec_of(src.config.architecture)
    if which == "A":
        return dict.fromkeys(spec.fused_projections[module.rsplit(".", 1)[-1]], t)
    if t.dim() != 2:
        raise src.error(f"tensor {name} has shape {list(t.shape)}; a LoRA B is 2-D")
    try:
        cut = spec.split_weight(f"{module}.weight", t, src.config)
    except ValueError as exc:
        raise src.error(f"tensor {name}: {exc}") from None
    parts = {}
    for part_name, rows in cut.items():
        assert isinstance(rows, torch.Tensor)
        parts[part_name.rsplit(".", 2)[-2]] = rows
    return parts


def _unfused(src: _Source, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT adapter's fused modules (Phi-3's qkv_proj) as one per projection
    (_fused_parts), under that projection's name."""
    fused_modules = spec_of(src.config.architecture).fused_projections
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _PEFT_RE.fullmatch(name)
        if not m or m.group(2) not in fused_modules:
            out[name] = t
            continue
        fused = m.group(2)
        for part, cut in _fused_parts(src, name, name.split(".lora_")[0], m.group(3), t).items():
            out[name.replace(f".{fused}.", f".{part}.")] = cut
    return out


def _gguf_unfused(src: _Source, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """_unfused for llama.cpp's names: an adapter of a fused tensor (Phi-3's attn_qkv,
    and its ffn_up, which holds gate and up) as one per projection under that
    projection's GGUF name. A file naming a projection twice (fused and apart) is refused."""
    spec = spec_of(src.config.architecture)
    gguf_name: dict[str, str] = {target: key for key, target in _GGUF_TARGETS.items()}
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        if name in out:
            raise src.error(f"adapts {name.split('.lora_')[0]} twice (fused and apart)")
        out[name] = t

    for name, t in tensors.items():
        m = _GGUF_RE.fullmatch(name)
        module = spec.gguf_layer_names.get(m.group(2), "") if m else ""
        if not m or module.rsplit(".", 1)[-1] not in spec.fused_projections:
            put(name, t)
            continue
        layer, which = m.group(1), m.group(3)
        path = f"model.layers.{layer}.{module}"
        for part, cut in _fused_parts(src, name, path, which.upper(), t).items():
            put(f"blk.{layer}.{gguf_name[part]}.weight.lora_{which}", cut)
    return out


_Pairs = dict[tuple[int, LoRATarget], tuple[torch.Tensor, torch.Tensor, str]]
# A tensor's name -> (its layer, MODEL_LAYER for the model's own modules; the target;
# "A" or "B"), or None where it is not a LoRA weight of anything this model adapts.
_NameParser = Callable[[str], tuple[int, str, str] | None]


def _name_parser(
    layer_re: re.Pattern[str], model_re: re.Pattern[str], renames: dict[str, LoRATarget]
) -> _NameParser:
    """A format's parser: each pattern's groups are (layer, or empty for the model's
    own modules; the target as the format names it, `renames` mapping it to ours; A/B)."""

    def parse(name: str) -> tuple[int, str, str] | None:
        m = layer_re.fullmatch(name) or model_re.fullmatch(name)
        if m is None:
            return None
        layer = int(m.group(1)) if m.group(1) else MODEL_LAYER
        return layer, renames.get(m.group(2), m.group(2)), m.group(3).upper()

    return parse


def _pairs(src: _Source, tensors: dict[str, torch.Tensor], parse: _NameParser) -> _Pairs:
    """(layer, target) -> (A, B, A's name) from tensor names; anything else is refused."""
    found: dict[tuple[int, LoRATarget], dict[str, tuple[str, torch.Tensor]]] = {}
    allowed = adaptable_targets(src.config)
    for name, t in tensors.items():
        layer, target, part = parse(name) or (0, "", "")
        # A layer's projection inside a layer, the embedding and head outside one.
        in_place = (layer == MODEL_LAYER) == (target in LORA_MODEL_TARGETS)
        if target not in allowed or not in_place:
            raise src.error(f"tensor {name} is not a LoRA weight of a supported projection")
        if layer >= src.config.num_layers:
            raise src.error(
                f"tensor {name}: layer {layer} past the model's {src.config.num_layers}"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise src.error(f"tensor {name} has dtype {t.dtype}; adapters are float32/16 or bf16")
        found.setdefault((layer, target), {})[part] = (name, t)
    if not found:
        raise src.error("holds no LoRA weights")
    pairs: _Pairs = {}
    for key, parts in found.items():
        if len(parts) != 2:
            ((name, _),) = parts.values()
            raise src.error(f"tensor {name} has no partner (every A needs its B)")
        (a_name, a), (_, b) = parts["A"], parts["B"]
        pairs[key] = (a, b, a_name)
    return pairs


def _adapter(
    src: _Source,
    pairs: _Pairs,
    ranks: dict[LoRATarget, int] | None,
    scale: float,
    digest: Any,
) -> LoRAAdapter:
    """The checked modules (A [r, in], B [out, r] with `scale` folded in, fp32)."""
    modules: dict[tuple[int, LoRATarget], LoRAModule] = {}
    for (layer, target), (a, b, name) in sorted(pairs.items()):
        fan_in, fan_out = target_shape(src.config, target)
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or a.shape[1] != fan_in or r > src.max_rank or r < 1:
            raise src.error(
                f"tensor {name} has shape {list(a.shape)}; expected [rank <= {src.max_rank}, "
                f"{fan_in}] for {target} of {src.config.name}"
            )
        if ranks is not None and r != ranks[target]:
            raise src.error(f"tensor {name} has rank {r}, the config says r={ranks[target]}")
        if list(b.shape) != [fan_out, r]:
            raise src.error(
                f"the B of {name} has shape {list(b.shape)}; expected [{fan_out}, {r}] "
                f"for {target} of {src.config.name}"
            )
        if target in ("q_proj", "k_proj"):  # B's rows as the model holds q/k's
            order = src.config.qk_row_order(fan_out // src.config.head_dim)
            b = b if order is None else b[order]
        a32, b32 = a.float().contiguous(), (b.float() * scale).contiguous()
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise src.error(f"tensor {name} or its B holds inf or NaN values")
        modules[(layer, target)] = LoRAModule(a32, b32)
    key = int.from_bytes(digest.digest()[:8], "little") >> 1
    rank = max(m.a.shape[0] for m in modules.values())
    return LoRAAdapter(src.name, str(src.path), key, rank, modules)


def _load_gguf(src: _Source) -> LoRAAdapter:
    """llama.cpp's adapter format (convert_lora_to_gguf.py): lora_a [r, in] and lora_b
    [out, r] per projection, adapter.lora.alpha; q/k's B rows permuted as the base's
    q/k rows are, so the family's transform undoes it."""
    _bounded_size(src, src.path)
    try:
        meta = GGUFMetadata.of(src.path)
        kind = (meta.get("general.type"), meta.get("adapter.type"))
        arch, alpha = meta.get("general.architecture"), meta.get("adapter.lora.alpha")
        activated = "adapter.alora.invocation_tokens" in meta
    except (ModelFileError, OSError) as exc:
        raise src.error(f"not a valid GGUF file: {exc}") from None
    if kind != ("adapter", "lora"):
        raise src.error("not a LoRA adapter GGUF (general.type adapter, adapter.type lora)")
    if activated:
        raise src.error("activated LoRA (adapter.alora.invocation_tokens) is not supported")
    spec = spec_of(src.config.architecture)
    if arch not in spec.gguf_names:
        raise src.error(f"made for a {arch!r} model; the base model is {spec.title}")
    tensors: dict[str, torch.Tensor] = {}
    for t in meta.tensors:
        try:
            raw = meta.tensor_data(t)
            data = np.array(dequantize(raw, t.tensor_type), dtype=np.float32)  # a copy
            shape = [int(d) for d in reversed(t.shape)]
            tensors[t.name] = torch.from_numpy(data).reshape(shape)
        # gguf raises NotImplementedError for a block type it cannot dequantize, and
        # ValueError/TypeError/RuntimeError for data that does not fit the shape.
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
            raise src.error(f"tensor {t.name} cannot be read: {exc}") from None
    tensors = _gguf_unfused(src, tensors)
    pairs = _pairs(src, tensors, _name_parser(_GGUF_RE, _GGUF_MODEL_RE, _GGUF_TARGETS))
    for (layer, target), (a, b, name) in pairs.items():
        if target == "embed_tokens":  # stored as A^T [vocab, r]: a token's row (llama.cpp)
            pairs[(layer, target)] = (a.t(), b, name)
        if layer == MODEL_LAYER:
            continue
        hf = f"model.layers.{layer}.self_attn.{target}.weight"
        unpermuted = spec.gguf_weight(hf, b, src.config)
        assert isinstance(unpermuted, torch.Tensor)  # a dense tensor stays dense
        pairs[(layer, target)] = (a, unpermuted, name)
    digest = hashlib.sha256(src.path.read_bytes())
    ranks = {a.shape[0] if a.dim() == 2 else 0 for a, _, _ in pairs.values()}
    if len(ranks) != 1:
        raise src.error(f"projections of different ranks {sorted(ranks)} are not supported")
    (rank,) = ranks
    if rank < 1:
        raise src.error("its lora_a tensors must be matrices of rank >= 1")
    if alpha is not None and (
        isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf
    ):
        raise src.error(f"adapter.lora.alpha must be a positive number, got {alpha!r}")
    # llama.cpp: alpha / rank, or 1 where the file gives no alpha.
    scale = float(alpha) / rank if alpha else 1.0
    return _adapter(src, pairs, None, scale, digest)
