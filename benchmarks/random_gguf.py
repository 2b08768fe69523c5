"""GGUF files laid out the way llama.cpp's converter and quantizer lay them out, from
small random Hugging Face models (correctness) or straight from a real model's shape
(speed and memory), for Mixture-of-Experts and dense models.

No Mixture-of-Experts model and no 3B-8B model is packaged (../shared/MODELS.md), so
sluice's loader is tested on these files against transformers and benchmarked on them
against llama.cpp, which runs the same file.

`hf_to_gguf` converts a transformers-saved directory (config.json, *.safetensors) as
llama.cpp's convert_hf_to_gguf.py (conversion/llama.py, granite.py, phi.py, qwen.py,
olmo.py, base.py in the vendored llama.cpp) does for LlamaForCausalLM, MistralForCausalLM,
MixtralForCausalLM ("llama"), GraniteForCausalLM ("granite"), Qwen2ForCausalLM,
Phi3ForCausalLM ("phi3"), Qwen3ForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
OlmoeForCausalLM, GraniteMoeForCausalLM and GraniteMoeSharedForCausalLM ("granitemoe":
Granite's keys and permutation; its experts' block_sparse_moe.input_linear [E, 2I, H]
becomes one blk.N.ffn_gate_up_exps, output_linear ffn_down_exps, router.layer
ffn_gate_inp; the shared expert's shared_mlp.input_linear [2S, H] is cut into
ffn_gate_shexp and ffn_up_shexp, its output_linear is ffn_down_shexp).
What it follows, and where the converter surprises:

- Names come from gguf's own tensor-name map, as the converter's do. Experts, saved one
  by one (`mlp.experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`), are
  stacked in expert order into blk.N.ffn_{gate,up,down}_exps, torch shape [E, I, H],
  [E, I, H], [E, H, I] (ggml ne {H, I, E} / {I, H, E}); the router is blk.N.ffn_gate_inp.
- The "llama" arch (Llama and Mixtral) gets the converter's q/k row permutation (HF's
  rotate-half rope to ggml's interleaved pairs); k uses the KV head count.
- Qwen2-MoE's `shared_expert_gate` [1, H] becomes blk.N.ffn_gate_inp_shexp 1-D [H]
  (`shexp_gate_1d`), as llama.cpp creates it ({n_embd}) and as every file llama.cpp's
  C code writes stores it: gguf.cpp writes ggml_n_dims dims, so llama-quantize's output
  (all published quantized files) has ne {H}, and transformers' GGUF reader expects
  that ("quantized one is (2048)"). convert_hf_to_gguf.py itself writes the tensor as
  saved, ne {H, 1}, in its F32/F16/Q8_0 files: shexp_gate_1d=False writes that form
  (llama.cpp loads both: trailing 1s match).
- OLMoE's q_norm/k_norm cover the whole projection ([H] and [kv_heads * head_dim]);
  llama.cpp creates both as {n_embd}, so it runs OLMoE only with kv_heads == heads.
- `expert_weights_norm` is written for none of these archs: the converter writes it only
  for other MoE families (DeepSeek, GLM, dots1, ...). llama.cpp's graphs hard-code it:
  normalized top-k weights for qwen3moe and llama (Mixtral), none for qwen2moe, olmoe.
- `attention.key_length`/`value_length` are written whenever config.json has a
  `head_dim` (transformers 5 saves one for Llama too), as the converter does; the
  llama arch also gets `vocab_size` and `rope.dimension_count`; a llama3 rope becomes
  the `rope_freqs.weight` tensor; OLMoE's rms epsilon is always 1e-5.
- Types as the converter's: 1-D tensors, *_norm.weight, biases, ffn_gate_inp and
  ffn_gate_inp_shexp stay F32; every other matrix (token_embd and output too) takes
  `tensor_type`, falling back to F16 where its rows don't split into blocks. Q4_0 is
  offered here though the converter has no such --outtype (llama-quantize makes it).

It reads one tensor (one expert) at a time. Checked beside transformers' GGUF reader,
which is written for llama.cpp's files: it gives back the saved weights exactly for
Llama (q/k un-permuted), Qwen2-MoE and Qwen3-MoE; for the MoE ones only when given the
HF config (it maps no expert_feed_forward_length), and it reads no Mixtral or OLMoE.

`write_shaped` writes random weights in a real model's shape (SHAPES), tensor by
tensor straight to disk (one bounded chunk in memory at a time), quantized as
llama-quantize's Q4_K_M (see `mix_type`) or Q8_0 would, with random quants under small
fixed block scales (weights of std ~0.018, zero mean) so activations stay finite.

Both copy the tokenizer (every tokenizer.* key: tokens, merges, types, special ids,
chat template) from `tokenizer_gguf`. Where the model's vocabulary is larger, the list
is padded as the converter pads one: token i is "[PAD{i}]", of type UNUSED (score
-1000 where there are scores). The text is meaningless; llama.cpp still loads it.

    python benchmarks/random_gguf.py shaped --shape olmoe-1b-7b --mix Q4_K_M --out /tmp/x.gguf
    python benchmarks/random_gguf.py convert HF_DIR OUT --type Q8_0
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from functools import lru_cache  # noqa: E402
from typing import Any  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402
from gguf import LlamaFileType, TokenType  # noqa: E402

A = gguf.MODEL_ARCH

HF_ARCHS: dict[str, gguf.MODEL_ARCH] = {
    "LlamaForCausalLM": A.LLAMA,
    "MistralForCausalLM": A.LLAMA,
    "MixtralForCausalLM": A.LLAMA,
    "GraniteForCausalLM": A.GRANITE,
    "GraniteMoeForCausalLM": A.GRANITE_MOE,
    "GraniteMoeSharedForCausalLM": A.GRANITE_MOE,
    "Phi3ForCausalLM": A.PHI3,
    "Qwen2ForCausalLM": A.QWEN2,
    "Qwen3ForCausalLM": A.QWEN3,
    "Qwen2MoeForCausalLM": A.QWEN2MOE,
    "Qwen3MoeForCausalLM": A.QWEN3MOE,
    "OlmoeForCausalLM": A.OLMOE,
    "GptOssForCausalLM": A.GPT_OSS,
}

# --type: the weight type and the general.file_type the converter writes with it.
TENSOR_TYPES: dict[str, tuple[QType, LlamaFileType]] = {
    "F32": (QType.F32, LlamaFileType.ALL_F32),
    "F16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "Q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (QType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    # gpt-oss as released: the experts in MXFP4 (the checkpoint's own blocks), the rest
    # as the converter's --outtype leaves it (F32 here).
    "MXFP4": (QType.MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE),
    # As ggml-org publishes gpt-oss: the experts in MXFP4, the other matrices in Q8_0.
    "MXFP4_Q8_0": (QType.MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE),
}
# The type of an MXFP4 file's matrices other than the experts, by --type (F32 else).
MXFP4_REST: dict[str, QType] = {"MXFP4_Q8_0": QType.Q8_0}

MIXES: dict[str, LlamaFileType] = {
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
}

CHUNK_BYTES = 32 << 20  # the most tensor data write_shaped holds at once


# ---- writing -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One tensor of a file: its data is produced only when it is written."""

    name: str
    shape: tuple[int, ...]  # torch order: ggml's ne reversed
    qtype: QType
    chunks: Callable[[], Iterator[np.ndarray]]  # the data, in file order, in pieces

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.qtype)


def tensor_nbytes(shape: Sequence[int], qtype: QType) -> int:
    """Bytes of a `qtype` tensor of torch shape `shape` (rows of shape[-1] values)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"rows of {shape[-1]} values don't split into {qtype.name} blocks")
    return math.prod(shape[:-1]) * (shape[-1] // block) * size


def write_gguf(writer: gguf.GGUFWriter, tensors: Sequence[TensorPlan]) -> None:
    """Header, metadata and tensor table through `writer`, then each tensor's data as its
    `chunks` produce it, aligned as GGUFWriter aligns it; closes the writer."""
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None and len(writer.fout) == 1
    fout = writer.fout[0]
    for t in tensors:
        writer.write_padding(fout, fout.tell())
        written = 0
        for chunk in t.chunks():
            np.ascontiguousarray(chunk).tofile(fout)
            written += chunk.nbytes
        if written != t.nbytes:
            raise AssertionError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")
        writer.write_padding(fout, t.nbytes)
    writer.close()


# ---- tokenizer -----------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _tokenizer_fields(path: str) -> tuple[tuple[str, Any, Any, Any], ...]:
    # GGUFReader takes seconds on a 50k-token vocabulary: read each file once.
    reader = gguf.GGUFReader(path)
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            main = field.types[0]
            sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), main, sub))
    return tuple(fields)


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer_gguf: Path, vocab_size: int) -> None:
    """Every tokenizer.* key of `tokenizer_gguf`, the token lists padded to `vocab_size`
    as convert_hf_to_gguf.py pads a vocabulary smaller than the model's."""
    fields = _tokenizer_fields(str(Path(tokenizer_gguf).resolve()))
    tokens = next(v for k, v, _, _ in fields if k == gguf.Keys.Tokenizer.LIST)
    if len(tokens) > vocab_size:
        raise ValueError(
            f"{tokenizer_gguf} has {len(tokens)} tokens, more than the model's {vocab_size}"
        )
    pad = range(len(tokens), vocab_size)
    pads = [f"[PAD{i}]" for i in pad]
    filler: dict[str, list[Any]] = {
        gguf.Keys.Tokenizer.LIST: pads,
        gguf.Keys.Tokenizer.TOKEN_TYPE: [int(TokenType.UNUSED)] * len(pad),
        gguf.Keys.Tokenizer.SCORES: [-1000.0] * len(pad),
    }
    if set(tokens) & set(pads):
        raise ValueError(f"{tokenizer_gguf} already has a [PAD<i>] token the padding needs")
    for key, value, vtype, sub in fields:
        if key in filler and pad:
            value = [*value, *filler[key]]
        writer.add_key_value(key, value, vtype, sub)


def default_tokenizer(vocab_size: int) -> Path:
    """A packaged GGUF whose tokenizer to copy: Qwen2.5-Coder's (151,936 tokens) for a
    vocabulary at least that large when it is installed, else SmolLM2's (49,152)."""
    from sluice.loader.resolve import resolve_model_path

    if vocab_size >= 151936:
        with contextlib.suppress(Exception):
            return Path(resolve_model_path("qwen2.5-coder-0.5b"))
    return Path(resolve_model_path(None))


# ---- converting a Hugging Face directory ---------------------------------------------------


def _find(config: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` that config has (not None), as the converter's find_hparam."""
    return next((config[k] for k in keys if config.get(k) is not None), None)


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters (transformers 5) or rope_scaling, with rope_theta and rope_type."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "rope_theta" not in rope and (theta := _find(config, "rope_theta")) is not None:
        rope["rope_theta"] = theta
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    return rope


def _add_phi3_metadata(w: gguf.GGUFWriter, config: dict[str, Any], ftype: LlamaFileType) -> None:
    """Phi3MiniModel.set_gguf_parameters, and the attention factor its extra tensors add."""
    rope = _rope(config)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    max_pos = config["max_position_embeddings"]
    original = rope.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings", max_pos
    )
    w.add_type(gguf.GGUFType.MODEL)
    w.add_context_length(max_pos)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    partial = rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    w.add_rope_dimension_count(int(partial * hidden) // heads)  # the converter's rounding
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_file_type(ftype)
    w.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = max_pos / original
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        w.add_rope_scaling_attn_factors(attn)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_hf_metadata(
    w: gguf.GGUFWriter, config: dict[str, Any], arch: gguf.MODEL_ARCH, ftype: LlamaFileType
) -> None:
    # TextModel.set_gguf_parameters, then each arch class's additions.
    if arch == A.PHI3:  # its own, not TextModel's
        return _add_phi3_metadata(w, config, ftype)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    rope = _rope(config)
    kind = rope.get("rope_type") or "default"
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind not in ("default", "llama3"):  # llama3: the rope_freqs tensor
        raise ValueError(f"rope_type {kind!r}: this writer knows default, linear, yarn and llama3")
    w.add_rope_freq_base(rope["rope_theta"])
    # OlmoeModel overwrites the epsilon with 1e-5 whatever config.json says.
    w.add_layer_norm_rms_eps(1e-5 if arch == A.OLMOE else config["rms_norm_eps"])
    if (experts := _find(config, "num_local_experts", "num_experts")) is not None:
        w.add_expert_count(experts)
    if (used := _find(config, "num_experts_per_tok")) is not None:
        w.add_expert_used_count(used)
    granite = arch in (A.GRANITE, A.GRANITE_MOE)
    head_dim = None if granite else config.get("head_dim")  # GraniteModel drops it
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(ftype)
    if arch == A.LLAMA or granite:
        w.add_vocab_size(config["vocab_size"])
        w.add_rope_dimension_count(
            head_dim or config["hidden_size"] // config["num_attention_heads"]
        )
    if granite:  # GraniteModel (and GraniteMoeModel): the multipliers, as *_scale keys
        for key, add in (
            ("attention_multiplier", w.add_attention_scale),
            ("embedding_multiplier", w.add_embedding_scale),
            ("residual_multiplier", w.add_residual_scale),
            ("logits_scaling", w.add_logit_scale),
        ):
            if config.get(key):
                add(config[key])
    if arch in (A.QWEN2MOE, A.QWEN3MOE):
        if (moe_ffn := config.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(moe_ffn)
        if (shared_ffn := config.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(shared_ffn)
    if arch == A.GRANITE_MOE and (shared_ffn := config.get("shared_intermediate_size")):
        w.add_expert_shared_feed_forward_length(shared_ffn)  # GraniteMoeShared
    if arch == A.GPT_OSS:  # GptOssModel.set_gguf_parameters
        w.add_sliding_window(config["sliding_window"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """rope_freqs.weight as LlamaModel.generate_extra_tensors computes it."""
    import torch

    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: q/k rows from HF's rotate-half rope to ggml's pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def converter_type(
    gguf_name: str, shape: Sequence[int], wanted: QType, rest: QType = QType.F32
) -> QType:
    """The type convert_hf_to_gguf.py gives a tensor when asked for `wanted`; `rest`:
    with MXFP4, the type of the matrices other than the experts."""
    kept_f32 = re.search(r"\.ffn_gate_inp(_shexp)?\.weight$", gguf_name)
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or kept_f32:
        return QType.F32
    if not gguf_name.endswith(".weight"):
        return QType.F32
    if wanted == QType.MXFP4 and not gguf_name.endswith("_exps.weight"):
        return QType.F32 if rest == QType.F32 else converter_type(gguf_name, shape, rest)
    if shape[-1] % gguf.GGML_QUANT_SIZES[wanted][0]:
        return QType.F16  # the converter's QuantError fallback
    return wanted


def _as_type(data: np.ndarray, qtype: QType) -> np.ndarray:
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


_EXPERT = re.compile(
    r"^(?P<layer>.*\.layers\.(?P<bid>\d+)\.(?:mlp|block_sparse_moe)\.experts)\.(?P<x>\d+)\.(?P<w>\w+)\.weight$"
)


class _Safetensors:
    """Every tensor of a directory's *.safetensors files, read on demand."""

    def __init__(self, hf_dir: Path, stack: contextlib.ExitStack) -> None:
        from safetensors import safe_open

        self.files: dict[str, Any] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        paths = sorted(Path(hf_dir).glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
        for path in paths:
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():
                self.files[name] = f
                self.shapes[name] = tuple(f.get_slice(name).get_shape())

    def load(self, name: str) -> np.ndarray:
        data: np.ndarray = self.files[name].get_tensor(name).float().numpy()
        return data


def _hf_tensors(
    st: _Safetensors,
    config: dict[str, Any],
    arch: gguf.MODEL_ARCH,
    wanted: QType,
    shexp_gate_1d: bool,
    rest: QType = QType.F32,
) -> list[TensorPlan]:
    """The converter's tensors, in its order: extra (rope_freqs) first, then the
    safetensors names sorted, each layer's experts where its last one comes."""
    n_layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    names = gguf.get_tensor_name_map(arch, n_layers)
    plans: list[TensorPlan] = []

    def add(gguf_name: str, shape: tuple[int, ...], load: Callable[[], np.ndarray]) -> None:
        qtype = converter_type(gguf_name, shape, wanted, rest)
        plans.append(TensorPlan(gguf_name, shape, qtype, lambda: iter([_as_type(load(), qtype)])))

    rope = _rope(config)
    if arch == A.PHI3 and rope.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
        for which in ("long", "short"):
            factors = np.asarray(rope[f"{which}_factor"], dtype=np.float32)
            add(f"rope_factors_{which}.weight", factors.shape, lambda f=factors: f)
    if arch == A.LLAMA and rope.get("rope_type") == "llama3":
        factors = llama3_rope_factors(
            rope, config.get("head_dim") or config["hidden_size"] // heads
        )
        add("rope_freqs.weight", factors.shape, lambda: factors)
    n_experts = _find(config, "num_local_experts", "num_experts") or 0
    pending: dict[str, list[tuple[int, str, str]]] = {}
    for name in sorted(st.shapes):
        if name.endswith((".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")):
            continue
        if m := _EXPERT.match(name):
            group = pending.setdefault(m["layer"], [])
            group.append((int(m["x"]), m["w"], name))
            if len(group) == 3 * n_experts:
                plans.extend(_stacked_experts(st, names, int(m["bid"]), group, wanted))
                del pending[m["layer"]]
            continue
        if arch == A.GPT_OSS and (parts := _gpt_oss_tensor(st, name)):
            for gguf_name, shape, load in parts:
                add(gguf_name, shape, load)
            continue
        if name.endswith(".shared_mlp.input_linear.weight"):
            # GraniteMoeShared's shared expert: gate rows, then up, cut in two.
            bid, size = name.split(".")[2], config["shared_intermediate_size"]
            for i, part in enumerate(("gate", "up")):
                rows = slice(i * size, (i + 1) * size)
                add(
                    f"blk.{bid}.ffn_{part}_shexp.weight",
                    (size, st.shapes[name][1]),
                    lambda name=name, rows=rows: st.load(name)[rows],
                )
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith(".block_sparse_moe.input_linear.weight"):
            # GraniteMoeModel keeps each expert's gate and up rows together, as its
            # checkpoint does: one ffn_gate_up_exps (gguf-py's map predates the name).
            gguf_name = f"blk.{name.split('.')[2]}.ffn_gate_up_exps.weight"
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {name!r} in arch {arch.name}")
        n = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0
        permute = arch in (A.LLAMA, A.GRANITE, A.GRANITE_MOE) and n > 0

        shape = st.shapes[name]
        if shexp_gate_1d and gguf_name.endswith(".ffn_gate_inp_shexp.weight"):
            shape = (math.prod(shape),)

        def load(
            name: str = name, n: int = n, permute: bool = permute, shape: tuple[int, ...] = shape
        ) -> np.ndarray:
            data = st.load(name).reshape(shape)
            return llama_permute(data, n) if permute else data

        add(gguf_name, shape, load)
    if pending:
        raise ValueError(f"incomplete experts (config has {n_experts}): {sorted(pending)}")
    return plans


def _gpt_oss_tensor(
    st: _Safetensors, name: str
) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """GptOssModel.modify_tensors for a checkpoint in floats: the experts' gate_up_proj
    [E, H, 2I] (gate and up interleaved column by column) as ffn_gate_exps and
    ffn_up_exps [E, I, H], down_proj [E, I, H] as ffn_down_exps [E, H, I], their biases
    cut likewise, the sinks as attn_sinks.weight; [] for any other tensor."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(\w+)|self_attn\.sinks)", name)
    if m is None:
        return []
    bid, part, shape = m[1], m[2], st.shapes[name]
    if part is None:
        return [(f"blk.{bid}.attn_sinks.weight", shape, lambda: st.load(name))]
    e = shape[0]
    if part == "gate_up_proj":
        cut = (e, shape[2] // 2, shape[1])
        return [
            (f"blk.{bid}.ffn_{w}_exps.weight", cut, lambda i=i: _gate_up(st.load(name), i))
            for i, w in enumerate(("gate", "up"))
        ]
    if part == "gate_up_proj_bias":
        cut = (e, shape[1] // 2)
        return [
            (f"blk.{bid}.ffn_{w}_exps.bias", cut, lambda i=i: st.load(name)[:, i::2].copy())
            for i, w in enumerate(("gate", "up"))
        ]
    if part == "down_proj":
        turned = (e, shape[2], shape[1])
        load = lambda: np.ascontiguousarray(st.load(name).transpose(0, 2, 1))  # noqa: E731
        return [(f"blk.{bid}.ffn_down_exps.weight", turned, load)]
    if part == "down_proj_bias":
        return [(f"blk.{bid}.ffn_down_exps.bias", shape, lambda: st.load(name))]
    raise ValueError(f"unknown gpt-oss expert tensor {name!r}")


def _gate_up(data: np.ndarray, which: int) -> np.ndarray:
    """Gate (which 0) or up (1) of gpt-oss's [E, H, 2I] gate_up_proj, as [E, I, H]."""
    return np.ascontiguousarray(data[:, :, which::2].transpose(0, 2, 1))


def _stacked_experts(
    st: _Safetensors,
    names: gguf.TensorNameMap,
    bid: int,
    group: list[tuple[int, str, str]],
    wanted: QType,
) -> list[TensorPlan]:
    # Qwen2MoeModel / OlmoeModel (down, gate, up) and LlamaModel (w1, w2, w3) merges,
    # under the merged names they map.
    plans = []
    for w in sorted({w for _, w, _ in group}):
        members = sorted((x, name) for x, ww, name in group if ww == w)
        if [x for x, _ in members] != list(range(len(members))):
            raise ValueError(f"layer {bid} {w}: experts {[x for x, _ in members]}")
        mixtral = w in ("w1", "w2", "w3")
        merged = (
            f"layers.{bid}.feed_forward.experts.{w}.weight"
            if mixtral
            else f"model.layers.{bid}.mlp.experts.{w}.weight"
        )
        gguf_name = names.get_name(merged, try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {merged!r}")
        shape = (len(members), *st.shapes[members[0][1]])
        qtype = converter_type(gguf_name, shape, wanted)

        def chunks(
            members: list[tuple[int, str]] = members, qtype: QType = qtype
        ) -> Iterator[np.ndarray]:
            for _, name in members:  # one expert at a time: rows are independent
                yield _as_type(st.load(name), qtype)

        plans.append(TensorPlan(gguf_name, shape, qtype, chunks))
    return plans


def hf_to_gguf(
    hf_dir: Path,
    out: Path,
    *,
    tensor_type: str = "F32",
    tokenizer_gguf: Path,
    shexp_gate_1d: bool = True,
) -> None:
    """Convert a transformers-saved model directory into a GGUF as llama.cpp's
    convert_hf_to_gguf.py lays it out (see the module docstring), with the tokenizer of
    `tokenizer_gguf`. `tensor_type`: F32, F16, Q8_0 or Q4_0 for the weight matrices;
    MXFP4 (the experts; the rest F32) or MXFP4_Q8_0 (the rest Q8_0) for gpt-oss.
    `shexp_gate_1d`: Qwen2-MoE's ffn_gate_inp_shexp as [H] (llama-quantize's files)
    rather than the converter's [1, H]."""
    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    if "text_config" in config:
        config = {**config, **config["text_config"]}
    hf_arch = config["architectures"][0]
    if hf_arch not in HF_ARCHS:
        raise ValueError(f"{hf_arch} is not one of {', '.join(HF_ARCHS)}")
    arch = HF_ARCHS[hf_arch]
    wanted, ftype = TENSOR_TYPES[tensor_type]
    rest = MXFP4_REST.get(tensor_type, QType.F32)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(hf_dir.name)
    _add_hf_metadata(writer, config, arch, ftype)
    add_tokenizer(writer, tokenizer_gguf, config["vocab_size"])
    out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        st = _Safetensors(hf_dir, stack)
        write_gguf(writer, _hf_tensors(st, config, arch, wanted, shexp_gate_1d, rest))


# ---- random weights in a real model's shape ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's sizes and the metadata the converter writes for it (from its config.json)."""

    arch: str  # GGUF architecture
    layers: int
    hidden: int
    ffn: int  # feed_forward_length: intermediate_size (OLMoE's experts use it)
    heads: int
    kv_heads: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    key_length: int | None = None  # config.json's head_dim, when it has one
    tied: bool = False  # no output.weight: the head is token_embd
    qkv_bias: bool = False
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int | None = None  # expert_feed_forward_length (qwen2moe, qwen3moe)
    shared_ffn: int | None = None  # expert_shared_feed_forward_length (qwen2moe)
    llama3_rope: tuple[tuple[str, float], ...] | None = None  # rope_freqs.weight
    # gpt-oss: the windowed layers' window, and YaRN's (factor, trained context).
    sliding_window: int | None = None
    yarn: tuple[float, int] | None = None

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    "qwen2.5-7b": Shape(
        arch="qwen2", layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4,
        vocab=152064, context=32768, rope_theta=1e6, rms_eps=1e-6, qkv_bias=True,
    ),
    "llama-3.1-8b": Shape(
        arch="llama", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8,
        vocab=128256, context=131072, rope_theta=500000.0, rms_eps=1e-5,
        llama3_rope=(
            ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
            ("original_max_position_embeddings", 8192),
        ),
    ),
    "qwen2.5-3b": Shape(
        arch="qwen2", layers=36, hidden=2048, ffn=11008, heads=16, kv_heads=2,
        vocab=151936, context=32768, rope_theta=1e6, rms_eps=1e-6, tied=True, qkv_bias=True,
    ),
    # OLMoE-1B-7B-0924: no shared expert, q/k norms over the whole projection, top-k
    # weights not renormalized (norm_topk_prob false; llama.cpp's olmoe graph agrees).
    "olmoe-1b-7b": Shape(
        arch="olmoe", layers=16, hidden=2048, ffn=1024, heads=16, kv_heads=16,
        vocab=50304, context=4096, rope_theta=10000.0, rms_eps=1e-5, experts=64,
        experts_used=8,
    ),
    # Qwen3-30B-A3B renormalizes its top-8 weights (norm_topk_prob true). The converter
    # writes no expert_weights_norm for qwen3moe (llama.cpp's graph always renormalizes),
    # so neither does this file: a loader must know it from the arch.
    # gpt-oss-20b: 32 experts of 2880 (4 a token) over hidden 2880, 64 query heads of
    # 64 and 8 KV heads; q/k/v/o, router and expert biases, a sink logit per head;
    # windows of 128 in the even layers; YaRN x32 over 4096 positions.
    "gpt-oss-20b": Shape(
        arch="gpt-oss", layers=24, hidden=2880, ffn=2880, heads=64, kv_heads=8,
        vocab=201088, context=131072, rope_theta=150000.0, rms_eps=1e-5, key_length=64,
        qkv_bias=True, experts=32, experts_used=4, expert_ffn=2880, sliding_window=128,
        yarn=(32.0, 4096),
    ),
    "qwen3-30b-a3b": Shape(
        arch="qwen3moe", layers=48, hidden=2048, ffn=6144, heads=32, kv_heads=4,
        vocab=151936, context=40960, rope_theta=1e6, rms_eps=1e-6, key_length=128,
        experts=128, experts_used=8, expert_ffn=768,
    ),
}  # fmt: skip


def _use_more_bits(layer: int, n_layers: int) -> bool:
    # llama-quant.cpp's use_more_bits
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


# MXFP4: gpt-oss as ggml-org publishes it, the experts in MXFP4 and the rest in Q8_0.
MIX_BASE: dict[str, QType] = {"Q4_K_M": QType.Q4_K, "Q8_0": QType.Q8_0, "MXFP4": QType.Q8_0}

_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}


def mix_type(mix: str, name: str, ne0: int, n_layers: int, n_experts: int, tied: bool) -> QType:
    """The type llama-quantize gives the quantizable tensor `name` (rows of `ne0`) for
    `mix`, following llama_tensor_get_type_impl for the tensors these archs have:

    Q4_K_M: Q4_K, except output.weight (token_embd.weight when tied) Q6_K; attn_v and
    every ffn_down* (exps, shexp) Q6_K in the layers use_more_bits picks (the first and
    last eighth, and every third between); with exactly 8 experts (Mixtral) attn_v and
    attn_k Q8_0, attn_output Q5_K. Q8_0: all Q8_0. Then llama-quantize's fallback where
    rows don't split into 256-value blocks (Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0) and F16
    where they don't split into 32 either. Layers count as llama-quantize counts them
    in the file written (`layers` of write_shaped included).
    """
    qtype = MIX_BASE[mix]
    if mix == "MXFP4" and name.endswith("_exps.weight"):
        return QType.MXFP4
    layer = int(m[1]) if (m := re.match(r"blk\.(\d+)\.", name)) else -1
    if mix == "Q4_K_M":
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            qtype = QType.Q6_K if ne0 % 256 == 0 else QType.Q8_0
        elif "attn_v.weight" in name:
            qtype = QType.Q6_K if _use_more_bits(layer, n_layers) else QType.Q4_K
            qtype = QType.Q8_0 if n_experts == 8 else qtype
        elif "attn_k.weight" in name and n_experts == 8:
            qtype = QType.Q8_0
        elif "ffn_down" in name and _use_more_bits(layer, n_layers):
            qtype = QType.Q6_K
        elif "attn_output.weight" in name and n_experts == 8:
            qtype = QType.Q5_K
    if ne0 % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK.get(qtype, qtype)
    return QType.F16 if ne0 % gguf.GGML_QUANT_SIZES[qtype][0] else qtype


# Fixed fields of each block type (byte offset, bytes) over random quants: weights
# d * (q - centre), std ~0.018 and zero mean, as in ggml-common.h's layouts. K-quant
# sub-block scales and mins are all 1 (6-bit packed: bytes 0-3 scales, 4-7 mins,
# 8-11 the low nibbles of both for sub-blocks 4-7), dmin = d * centre.
_F16 = np.float16


def _h(*values: float) -> bytes:
    return np.array(values, dtype=_F16).tobytes()


_BLOCK_FIELDS: dict[QType, list[tuple[int, bytes]]] = {
    QType.Q4_0: [(0, _h(2**-8))],
    QType.Q5_0: [(0, _h(2**-9))],
    QType.Q5_1: [(0, _h(2**-9, -15.5 * 2**-9))],
    QType.Q8_0: [(0, _h(2**-12))],
    QType.Q4_K: [(0, _h(2**-8, 7.5 * 2**-8)), (4, bytes([1] * 8 + [0x11] * 4))],
    QType.Q5_K: [(0, _h(2**-9, 15.5 * 2**-9)), (4, bytes([1] * 8 + [0x11] * 4))],
    QType.Q6_K: [(192, bytes([1] * 16) + _h(2**-10))],
    QType.MXFP4: [(0, bytes([120]))],  # 2**-8 times the doubled E2M1 values
}


def _random_chunks(
    shape: tuple[int, ...], qtype: QType, seed: Sequence[int]
) -> Iterator[np.ndarray]:
    """Random `qtype` data of `shape`, CHUNK_BYTES at most at a time."""
    rng = np.random.default_rng(list(seed))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = shape[-1] // block * size
    rows = math.prod(shape[:-1])
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if qtype in (QType.F32, QType.F16):
            values = rng.standard_normal((n, shape[-1]), dtype=np.float32) * 0.018
            yield values.astype(np.float32 if qtype == QType.F32 else np.float16)
            continue
        blocks = np.frombuffer(bytearray(rng.bytes(n * row_bytes)), np.uint8).reshape(-1, size)
        for offset, value in _BLOCK_FIELDS[qtype]:
            blocks[:, offset : offset + len(value)] = np.frombuffer(value, np.uint8)
        yield blocks


def _shaped_layer(s: Shape, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, torch shape, kind) of layer i; kind: "w" a matrix, "one" a norm, "rand" F32."""
    h, hd, q, kv = s.hidden, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim
    p = f"blk.{i}."
    oss = s.arch == "gpt-oss"
    t = [
        (p + "attn_norm.weight", (h,), "one"),
        (p + "attn_q.weight", (q, h), "w"),
        (p + "attn_k.weight", (kv, h), "w"),
        (p + "attn_v.weight", (kv, h), "w"),
        (p + "attn_output.weight", (h, q), "w"),
        (p + ("post_attention_norm" if oss else "ffn_norm") + ".weight", (h,), "one"),
    ]
    if s.qkv_bias:
        t += [(p + f"attn_{x}.bias", (n,), "rand") for x, n in (("q", q), ("k", kv), ("v", kv))]
    if oss:
        t += [(p + "attn_output.bias", (h,), "rand"), (p + "attn_sinks.weight", (s.heads,), "rand")]
        e, f = s.experts, s.expert_ffn or s.ffn
        t += [(p + "ffn_gate_inp.bias", (e,), "rand"), (p + "ffn_down_exps.bias", (e, h), "rand")]
        t += [(p + f"ffn_{x}_exps.bias", (e, f), "rand") for x in ("gate", "up")]
    if s.arch == "olmoe":  # over the whole projection
        t += [(p + "attn_q_norm.weight", (q,), "one"), (p + "attn_k_norm.weight", (kv,), "one")]
    elif s.arch in ("qwen3", "qwen3moe"):
        t += [(p + "attn_q_norm.weight", (hd,), "one"), (p + "attn_k_norm.weight", (hd,), "one")]
    if not s.experts:
        f = s.ffn
        t += [(p + "ffn_gate.weight", (f, h), "w"), (p + "ffn_up.weight", (f, h), "w")]
        t += [(p + "ffn_down.weight", (h, f), "w")]
        return t
    e, f = s.experts, s.expert_ffn or s.ffn
    t += [
        (p + "ffn_gate_inp.weight", (e, h), "rand"),
        (p + "ffn_gate_exps.weight", (e, f, h), "w"),
        (p + "ffn_up_exps.weight", (e, f, h), "w"),
        (p + "ffn_down_exps.weight", (e, h, f), "w"),
    ]
    if s.shared_ffn:
        f = s.shared_ffn
        t += [
            (p + "ffn_gate_inp_shexp.weight", (h,), "rand"),  # llama-quantize: 1-D
            (p + "ffn_gate_shexp.weight", (f, h), "w"),
            (p + "ffn_up_shexp.weight", (f, h), "w"),
            (p + "ffn_down_shexp.weight", (h, f), "w"),
        ]
    return t


def shaped_tensors(s: Shape, mix: str, seed: int = 0) -> list[TensorPlan]:
    """The tensors of `s` in llama-quantize's output order (the non-layer tensors by
    name, then each layer's by name), random data produced as each is written."""
    top = [
        ("output_norm.weight", (s.hidden,), "one"),
        ("token_embd.weight", (s.vocab, s.hidden), "w"),
    ]
    if not s.tied:
        top.append(("output.weight", (s.vocab, s.hidden), "w"))
    if s.llama3_rope:
        top.append(("rope_freqs.weight", (s.head_dim // 2,), "rope"))
    layers = [sorted(_shaped_layer(s, i)) for i in range(s.layers)]
    plans = []
    for index, (name, shape, kind) in enumerate(sorted(top) + [t for lay in layers for t in lay]):
        if kind == "w":
            qtype = mix_type(mix, name, shape[-1], s.layers, s.experts, s.tied)
            data = _random_chunks_fn(shape, qtype, (seed, index))
        elif kind == "one":
            qtype, data = QType.F32, _const_fn(np.ones(shape, np.float32))
        elif kind == "rope":
            rope = {"rope_theta": s.rope_theta, **dict(s.llama3_rope or ())}
            qtype, data = QType.F32, _const_fn(llama3_rope_factors(rope, s.head_dim))
        else:
            qtype, data = QType.F32, _random_chunks_fn(shape, QType.F32, (seed, index))
        plans.append(TensorPlan(name, shape, qtype, data))
    return plans


def _random_chunks_fn(
    shape: tuple[int, ...], qtype: QType, seed: Sequence[int]
) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: _random_chunks(shape, qtype, seed)


def _const_fn(value: np.ndarray) -> Callable[[], Iterator[np.ndarray]]:
    return lambda: iter([value])


def _add_shaped_metadata(w: gguf.GGUFWriter, s: Shape, ftype: LlamaFileType) -> None:
    # What _add_hf_metadata writes for the real model's config.json.
    w.add_type(gguf.GGUFType.MODEL)
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
    if s.key_length is not None:
        w.add_key_length(s.key_length)
        w.add_value_length(s.key_length)
    w.add_file_type(ftype)
    if s.arch == "llama":
        w.add_vocab_size(s.vocab)
        w.add_rope_dimension_count(s.head_dim)
    if s.expert_ffn is not None:
        w.add_expert_feed_forward_length(s.expert_ffn)
    if s.shared_ffn is not None:
        w.add_expert_shared_feed_forward_length(s.shared_ffn)
    if s.sliding_window is not None:
        w.add_sliding_window(s.sliding_window)
    if s.yarn is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn[0])
        w.add_rope_scaling_orig_ctx_len(s.yarn[1])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_shaped(
    out: Path,
    shape: str,
    *,
    mix: str = "Q4_K_M",
    layers: int | None = None,
    tokenizer_gguf: Path,
    seed: int = 0,
) -> None:
    """A random-weight GGUF in the shape SHAPES[shape] (`layers` of them if given),
    quantized as llama-quantize's `mix` (Q4_K_M or Q8_0) would be, written tensor by
    tensor; the tokenizer copied from `tokenizer_gguf`, padded to the shape's vocab."""
    s = SHAPES[shape]
    if layers is not None:
        s = dataclasses.replace(s, layers=layers)
    if mix not in MIXES:
        raise ValueError(f"mix {mix!r} is not one of {', '.join(MIXES)}")
    out = Path(out)
    writer = gguf.GGUFWriter(out, s.arch)
    writer.add_name(f"random {shape}")
    _add_shaped_metadata(writer, s, MIXES[mix])
    add_tokenizer(writer, tokenizer_gguf, s.vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(writer, shaped_tensors(s, mix, seed))


# ---- command line ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sh = sub.add_parser("shaped", help="random weights in a real model's shape")
    sh.add_argument("--shape", required=True, choices=sorted(SHAPES))
    sh.add_argument("--mix", default="Q4_K_M", choices=sorted(MIXES))
    sh.add_argument("--out", required=True, type=Path)
    sh.add_argument("--layers", type=int, help="override the layer count")
    sh.add_argument("--seed", type=int, default=0)
    sh.add_argument("--tokenizer", type=Path, help="GGUF to copy the tokenizer from")
    cv = sub.add_parser("convert", help="a transformers-saved directory to GGUF")
    cv.add_argument("hf_dir", type=Path)
    cv.add_argument("out", type=Path)
    cv.add_argument("--type", default="F32", choices=sorted(TENSOR_TYPES))
    cv.add_argument("--tokenizer", type=Path, help="GGUF to copy the tokenizer from")
    args = ap.parse_args(argv)
    if args.command == "shaped":
        tok = args.tokenizer or default_tokenizer(SHAPES[args.shape].vocab)
        write_shaped(
            args.out, args.shape, mix=args.mix, layers=args.layers, tokenizer_gguf=tok,
            seed=args.seed,
        )  # fmt: skip
    else:
        vocab = json.loads((args.hf_dir / "config.json").read_text())["vocab_size"]
        tok = args.tokenizer or default_tokenizer(vocab)
        hf_to_gguf(args.hf_dir, args.out, tensor_type=args.type, tokenizer_gguf=tok)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
