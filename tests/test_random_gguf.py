"""benchmarks/random_gguf.py writes GGUF files as llama.cpp's converter and quantizer
lay them out: small random transformers models converted (names, ggml shapes, types,
metadata, the weights themselves), and random weights in a model's shape (types as
llama-quantize picks them, byte sizes, finite small values)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as QType

from benchmarks import random_gguf
from benchmarks.random_gguf import SHAPES, Shape, hf_to_gguf, shaped_tensors, write_shaped

TINY_TOKENS = 320  # the tiny tokenizer's tokens; the tiny models' vocabulary is larger
VOCAB = 352


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer-only GGUF of TINY_TOKENS tokens (reading SmolLM2's 49,152 takes seconds)."""
    path = tmp_path_factory.mktemp("tok") / "tiny-vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"t{i}" for i in range(3, TINY_TOKENS)]
    )
    w.add_token_types([3, 3, 3] + [1] * (TINY_TOKENS - 3))
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- small random transformers models ------------------------------------------------------

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
_MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2)
_LLAMA3: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config(kind: str) -> Any:
    t = transformers
    if kind == "llama":  # llama3 rope: rope_freqs.weight
        return t.LlamaConfig(**_COMMON, rope_parameters=_LLAMA3)
    if kind == "qwen2":
        return t.Qwen2Config(**{**_COMMON, "tie_word_embeddings": True})
    if kind == "qwen3":
        return t.Qwen3Config(**_COMMON, head_dim=32)
    if kind == "mixtral":
        return t.MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2)
    if kind == "qwen2moe":  # shared expert of 48: rows that don't split into 32-blocks
        return t.Qwen2MoeConfig(
            **_COMMON, **_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
    if kind == "qwen3moe":
        return t.Qwen3MoeConfig(**_COMMON, **_MOE, moe_intermediate_size=32, head_dim=32)
    if kind == "olmoe":  # llama.cpp's olmoe has no GQA; its config's epsilon is ignored
        return t.OlmoeConfig(**{**_COMMON, **_MOE, "num_key_value_heads": 4})
    raise ValueError(kind)


KINDS = ("llama", "qwen2", "qwen3", "mixtral", "qwen2moe", "qwen3moe", "olmoe")
ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "llama",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
    "olmoe": "olmoe",
}


def _build(kind: str, directory: Path, **overrides: Any) -> dict[str, np.ndarray]:
    """Save a seeded random model of `kind`; returns its saved tensors (float32)."""
    import torch
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    config = _config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases that are not all ones / zeros
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    model.save_pretrained(directory)
    return load_file(str(directory / "model.safetensors"))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, written out again.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps.weight",
    "up_proj": "ffn_up_exps.weight",
    "down_proj": "ffn_down_exps.weight",
    "w1": "ffn_gate_exps.weight",
    "w3": "ffn_up_exps.weight",
    "w2": "ffn_down_exps.weight",
}


def _expected(
    kind: str, hf: dict[str, np.ndarray], config: Any, shexp_gate_1d: bool = True
) -> dict[str, np.ndarray]:
    """The GGUF tensors (torch order) llama.cpp's converter makes of `hf` (the shared
    expert's gate 1-D as llama-quantize rewrites it, unless not `shexp_gate_1d`)."""
    out: dict[str, np.ndarray] = {"token_embd.weight": hf["model.embed_tokens.weight"]}
    out["output_norm.weight"] = hf["model.norm.weight"]
    if "lm_head.weight" in hf:
        out["output.weight"] = hf["lm_head.weight"]
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, value in hf.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if not m:
            continue
        p = f"blk.{m[1]}."
        if e := re.match(r".*experts\.(\d+)\.(\w+)\.weight", m[2]):
            experts.setdefault(p + _EXPERT_NAMES[e[2]], []).append((int(e[1]), value))
            continue
        if ARCH[kind] == "llama" and ".q_proj." in name:
            value = _permute(value, config.num_attention_heads)
        if ARCH[kind] == "llama" and ".k_proj." in name:
            value = _permute(value, config.num_key_value_heads)
        if m[2] == "mlp.shared_expert_gate.weight" and shexp_gate_1d:
            value = value.reshape(-1)
        out[p + _LAYER_NAMES[m[2]]] = value
    for name, members in experts.items():
        out[name] = np.stack([v for _, v in sorted(members, key=lambda x: x[0])])
    return out


def _fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _ne(t: Any) -> list[int]:
    return [int(n) for n in t.shape]


@pytest.mark.parametrize("kind", KINDS)
def test_f32_conversion_is_the_converters(kind: str, tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Names, ggml shapes, metadata and every F32 value as convert_hf_to_gguf.py writes
    them: experts stacked in order, llama q/k permuted, the vocabulary padded."""
    hf = _build(kind, tmp_path / "hf")
    config = _config(kind)
    hf_to_gguf(tmp_path / "hf", tmp_path / "m.gguf", tokenizer_gguf=tiny_tokenizer)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    expected = _expected(kind, hf, config)
    if kind == "llama":
        expected["rope_freqs.weight"] = tensors["rope_freqs.weight"].data  # checked below
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        t = tensors[name]
        assert t.tensor_type == QType.F32, name
        assert _ne(t) == list(reversed(value.shape)), name
        np.testing.assert_array_equal(t.data, value, err_msg=name)
    _check_metadata(kind, _fields(reader), config)
    _check_llama_cpp_shapes(kind, tensors)


def _check_metadata(kind: str, f: dict[str, Any], config: Any) -> None:
    arch = ARCH[kind]
    assert f["general.architecture"] == arch
    want: dict[str, Any] = {
        "block_count": 2,
        "context_length": 256,
        "embedding_length": 64,
        "feed_forward_length": 64,
        "attention.head_count": 4,
        "attention.head_count_kv": 4 if kind == "olmoe" else 2,
        "rope.freq_base": 500000.0 if kind == "llama" else config.rope_parameters["rope_theta"],
    }
    if kind in ("mixtral", "qwen2moe", "qwen3moe", "olmoe"):
        want |= {"expert_count": 8, "expert_used_count": 2}
    if kind in ("qwen2moe", "qwen3moe"):
        want["expert_feed_forward_length"] = 32
    if kind == "qwen2moe":
        want["expert_shared_feed_forward_length"] = 48
    if kind in ("llama", "qwen3", "qwen3moe"):  # config.json has a head_dim
        head_dim = 16 if kind == "llama" else 32
        want |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    if arch == "llama":
        want |= {"vocab_size": VOCAB, "rope.dimension_count": 16}
    for key, value in want.items():
        assert f[f"{arch}.{key}"] == pytest.approx(value), key
    # The converter writes no expert_weights_norm for any of these archs.
    assert f"{arch}.expert_weights_norm" not in f
    eps = 1e-5 if kind == "olmoe" else 1e-6  # OlmoeModel writes 1e-5 whatever the config
    assert f[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(eps)
    assert f["general.file_type"] == gguf.LlamaFileType.ALL_F32
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == VOCAB and tokens[TINY_TOKENS - 1] == f"t{TINY_TOKENS - 1}"
    assert tokens[TINY_TOKENS:] == [f"[PAD{i}]" for i in range(TINY_TOKENS, VOCAB)]
    assert f["tokenizer.ggml.token_type"][TINY_TOKENS:] == [5] * (VOCAB - TINY_TOKENS)
    assert f["tokenizer.ggml.merges"] == ["t 1", "t 2"]
    assert f["tokenizer.chat_template"] == "{{ messages }}"


def _check_llama_cpp_shapes(kind: str, tensors: dict[str, Any]) -> None:
    # The ggml shapes llama.cpp's src/models/<arch>.cpp create_tensor asks for.
    if kind in ("mixtral", "qwen2moe", "qwen3moe", "olmoe"):
        ffn = 64 if kind in ("mixtral", "olmoe") else 32
        assert _ne(tensors["blk.1.ffn_gate_inp.weight"]) == [64, 8]
        assert _ne(tensors["blk.1.ffn_gate_exps.weight"]) == [64, ffn, 8]
        assert _ne(tensors["blk.1.ffn_up_exps.weight"]) == [64, ffn, 8]
        assert _ne(tensors["blk.1.ffn_down_exps.weight"]) == [ffn, 64, 8]
    if kind == "qwen2moe":  # {n_embd}, as llama-quantize's files store it
        assert _ne(tensors["blk.0.ffn_gate_inp_shexp.weight"]) == [64]
        assert _ne(tensors["blk.0.ffn_gate_shexp.weight"]) == [64, 48]
    if kind == "olmoe":  # over the whole projection
        assert _ne(tensors["blk.0.attn_q_norm.weight"]) == [64]
        assert _ne(tensors["blk.0.attn_k_norm.weight"]) == [64]
    if kind in ("qwen3", "qwen3moe"):  # per head
        assert _ne(tensors["blk.0.attn_q_norm.weight"]) == [32]
        assert _ne(tensors["blk.0.attn_q.weight"]) == [64, 128]
    if kind == "llama":  # llama3 rope: the converter's factors, one per rotary pair
        factors = tensors["rope_freqs.weight"].data
        np.testing.assert_allclose(factors, _llama3_factors(), rtol=1e-6)


def _llama3_factors() -> np.ndarray:
    # Llama 3's rope scaling written out: head_dim 16, _LLAMA3's parameters.
    dim, r = 16, _LLAMA3
    freqs = 1.0 / r["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * np.pi / freqs
    old = r["original_max_position_embeddings"]
    smooth = (old / wavelen - r["low_freq_factor"]) / (r["high_freq_factor"] - r["low_freq_factor"])
    mid = 1 / ((1 - smooth) / r["factor"] + smooth)
    low_wavelen, high_wavelen = old / r["low_freq_factor"], old / r["high_freq_factor"]
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, r["factor"], mid))


def test_converters_2d_shexp_gate(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """shexp_gate_1d=False: the shared expert's gate as convert_hf_to_gguf.py writes
    it, [1, H] (ggml ne {H, 1}); llama.cpp loads that too."""
    hf = _build("qwen2moe", tmp_path / "hf")
    hf_to_gguf(
        tmp_path / "hf", tmp_path / "m.gguf", tokenizer_gguf=tiny_tokenizer, shexp_gate_1d=False
    )
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    gate = tensors["blk.1.ffn_gate_inp_shexp.weight"]
    assert _ne(gate) == [64, 1] and gate.tensor_type == QType.F32
    np.testing.assert_array_equal(gate.data, hf["model.layers.1.mlp.shared_expert_gate.weight"])


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0", "Q4_0"])
def test_quantized_conversion(tensor_type: str, tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Every matrix, token_embd and 3-D experts included, in the type asked for, byte for
    byte gguf.quants.quantize's; norms, biases, the routers F32; rows of 48 fall back to
    F16 as the converter falls back."""
    hf = _build("qwen2moe", tmp_path / "hf")
    hf_to_gguf(
        tmp_path / "hf", tmp_path / "m.gguf", tensor_type=tensor_type, tokenizer_gguf=tiny_tokenizer
    )
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    wanted, ftype = random_gguf.TENSOR_TYPES[tensor_type]
    assert _fields(reader)["general.file_type"] == ftype
    expected = _expected("qwen2moe", hf, _config("qwen2moe"))
    for t in reader.tensors:
        value = expected[t.name]
        f32 = value.ndim == 1 or t.name.endswith(
            ("_norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
        )
        qtype = QType.F32 if f32 else QType.F16 if value.shape[-1] == 48 else wanted
        assert t.tensor_type == qtype, t.name
        assert _ne(t) == list(reversed(value.shape)), t.name
        want = gguf.quants.quantize(value, qtype)
        assert np.array_equal(t.data.view(np.uint8), want.view(np.uint8)), t.name
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == types["blk.0.ffn_gate_exps.weight"] == wanted
    assert types["blk.0.ffn_down_shexp.weight"] == QType.F16


def test_smollm2_tokenizer_is_copied(tmp_path: Path, smollm2_path: Path) -> None:
    """A vocabulary of SmolLM2's size: its tokenizer copied whole, nothing padded."""
    _build("qwen3moe", tmp_path / "hf", vocab_size=49152)
    hf_to_gguf(tmp_path / "hf", tmp_path / "m.gguf", tokenizer_gguf=smollm2_path)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    # SmolLM2's fields as the conversion read them (GGUFReader, cached: seconds each read)
    source = {
        k: (v, t) for k, v, t, _ in random_gguf._tokenizer_fields(str(smollm2_path.resolve()))
    }
    keys = sorted(k for k in reader.fields if k.startswith("tokenizer."))
    assert keys == sorted(source)
    assert "tokenizer.ggml.merges" in keys and "tokenizer.chat_template" in keys
    for key in keys:
        field = reader.fields[key]
        assert (field.contents(), field.types[0]) == source[key], key
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152


# ---- random weights in a model's shape -----------------------------------------------------

TINY_SHAPES = {
    # 8 experts: llama-quantize's Mixtral rule (attn_v/attn_k Q8_0, attn_output Q5_K)
    "tiny-olmoe": dataclasses.replace(
        SHAPES["olmoe-1b-7b"], hidden=256, ffn=256, heads=4, kv_heads=4, vocab=VOCAB, experts=8
    ),
    "tiny-qwen3moe": dataclasses.replace(
        SHAPES["qwen3-30b-a3b"], hidden=256, heads=4, kv_heads=2, vocab=VOCAB, experts=16,
        expert_ffn=256, ffn=512,
    ),
    "tiny-llama": dataclasses.replace(
        SHAPES["llama-3.1-8b"], hidden=256, ffn=512, heads=4, kv_heads=2, vocab=VOCAB
    ),
    # rows of 288: llama-quantize's fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0)
    "tiny-qwen2": dataclasses.replace(
        SHAPES["qwen2.5-3b"], hidden=256, ffn=288, heads=4, kv_heads=2, vocab=VOCAB
    ),
    "tiny-gpt-oss": dataclasses.replace(
        SHAPES["gpt-oss-20b"], hidden=256, ffn=256, expert_ffn=256, heads=4, kv_heads=2,
        vocab=VOCAB, experts=8,
    ),
    "tiny-qwen2moe": Shape(
        arch="qwen2moe", layers=24, hidden=256, ffn=512, heads=4, kv_heads=4, vocab=VOCAB,
        context=512, rope_theta=1e6, rms_eps=1e-6, qkv_bias=True, experts=4, experts_used=2,
        expert_ffn=256, shared_ffn=512,
    ),
}  # fmt: skip


@pytest.fixture
def tiny_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random_gguf, "SHAPES", {**SHAPES, **TINY_SHAPES})


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.usefixtures("tiny_shapes")
@pytest.mark.parametrize(
    ("shape", "mix"),
    [(shape, mix) for shape in sorted(TINY_SHAPES) for mix in ("Q4_K_M", "Q8_0")]
    + [("tiny-gpt-oss", "MXFP4")],
)
def test_write_shaped(shape: str, mix: str, tmp_path: Path, tiny_tokenizer: Path) -> None:
    """One layer of a shape: the tensors llama.cpp creates for its arch, in the types
    llama-quantize picks, their byte sizes right, values finite, small and zero-mean."""
    s = dataclasses.replace(TINY_SHAPES[shape], layers=1)
    path = tmp_path / "m.gguf"
    write_shaped(path, shape, mix=mix, layers=1, tokenizer_gguf=tiny_tokenizer)
    reader = gguf.GGUFReader(path)
    plans = {p.name: p for p in shaped_tensors(s, mix)}
    assert [t.name for t in reader.tensors] == list(plans)  # llama-quantize's order
    end = 0
    for t in reader.tensors:
        p = plans[t.name]
        assert _ne(t) == list(reversed(p.shape)) and t.tensor_type == p.qtype, t.name
        block, size = gguf.GGML_QUANT_SIZES[p.qtype]
        assert t.n_bytes == np.prod(p.shape[:-1]) * p.shape[-1] // block * size, t.name
        assert t.data_offset % 32 == 0 and t.data_offset >= end
        end = t.data_offset + t.n_bytes
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), t.name
        if t.name.endswith("norm.weight"):
            assert (values == 1).all()
        elif t.tensor_type == QType.MXFP4:  # 2**-8 times values of RMS 5.85
            assert 0.021 < values.std() < 0.025, t.name
            assert abs(values.mean()) < 0.001 + 4 * 0.023 / np.sqrt(values.size), t.name
        elif t.name != "rope_freqs.weight" and values.size >= 64:  # ~0.018: mean within 4 sigma
            assert 0.015 < values.std() < 0.022, t.name
            assert abs(values.mean()) < 0.001 + 4 * 0.018 / np.sqrt(values.size), t.name
    assert path.stat().st_size == end
    f = _fields(reader)
    assert f["general.architecture"] == s.arch and f[f"{s.arch}.block_count"] == 1
    assert f["general.file_type"] == random_gguf.MIXES[mix]
    assert len(f["tokenizer.ggml.tokens"]) == VOCAB
    assert f"{s.arch}.expert_weights_norm" not in f
    _check_shaped_tensors(s, plans)


def _check_shaped_tensors(s: Shape, plans: dict[str, Any]) -> None:
    h, q = s.hidden, s.heads * s.head_dim
    assert ("output.weight" in plans) != s.tied
    assert plans["blk.0.attn_q.weight"].shape == (q, h)
    assert plans["blk.0.attn_output.weight"].shape == (h, q)
    assert ("blk.0.attn_q.bias" in plans) == s.qkv_bias
    assert ("rope_freqs.weight" in plans) == (s.llama3_rope is not None)
    if s.arch == "olmoe":
        assert plans["blk.0.attn_q_norm.weight"].shape == (q,)
    if s.arch == "qwen3moe":
        assert plans["blk.0.attn_k_norm.weight"].shape == (s.head_dim,)
    if s.experts:
        f = s.expert_ffn or s.ffn
        assert plans["blk.0.ffn_gate_inp.weight"].qtype == QType.F32
        assert plans["blk.0.ffn_up_exps.weight"].shape == (s.experts, f, h)
        assert plans["blk.0.ffn_down_exps.weight"].shape == (s.experts, h, f)
    if s.shared_ffn:
        assert plans["blk.0.ffn_gate_inp_shexp.weight"].shape == (h,)
    if s.arch == "gpt-oss":  # sinks, the output and MoE biases, the second norm's name
        f = s.expert_ffn or s.ffn
        assert plans["blk.0.attn_sinks.weight"].shape == (s.heads,)
        assert plans["blk.0.attn_output.bias"].shape == (h,)
        assert plans["blk.0.ffn_gate_inp.bias"].shape == (s.experts,)
        assert plans["blk.0.ffn_up_exps.bias"].shape == (s.experts, f)
        assert plans["blk.0.ffn_down_exps.bias"].shape == (s.experts, h)
        assert "blk.0.post_attention_norm.weight" in plans and "blk.0.ffn_norm.weight" not in plans


@pytest.mark.usefixtures("tiny_shapes")
def test_write_shaped_is_deterministic(tmp_path: Path, tiny_tokenizer: Path) -> None:
    a, b, c = (tmp_path / f"{n}.gguf" for n in "abc")
    for path, seed in ((a, 0), (b, 0), (c, 1)):
        write_shaped(path, "tiny-qwen3moe", layers=1, tokenizer_gguf=tiny_tokenizer, seed=seed)
    assert _sha(a) == _sha(b) != _sha(c)


def _types(shape: str, mix: str = "Q4_K_M") -> dict[str, QType]:
    return {p.name: p.qtype for p in shaped_tensors(SHAPES[shape], mix)}


def _layers_of(types: dict[str, QType], suffix: str, qtype: QType) -> list[int]:
    return sorted(
        int(n.split(".")[1]) for n, t in types.items() if n.endswith(suffix) and t == qtype
    )


def test_q4_k_m_follows_llama_quantize() -> None:
    """Q4_K_M on the real shapes (nothing written): Q6_K for output (token_embd when
    tied), for attn_v and ffn_down in use_more_bits' layers, Q4_K for the rest."""
    t = _types("qwen2.5-7b")  # 28 layers: the first and last 3-4, then every third
    more_bits = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert _layers_of(t, "attn_v.weight", QType.Q6_K) == more_bits
    assert _layers_of(t, "ffn_down.weight", QType.Q6_K) == more_bits
    assert t["output.weight"] == QType.Q6_K and t["token_embd.weight"] == QType.Q4_K
    assert {t[f"blk.3.{n}.weight"] for n in ("attn_q", "attn_k", "attn_v", "ffn_up")} == {
        QType.Q4_K
    }
    assert t["blk.0.attn_q.bias"] == QType.F32
    tied = _types("qwen2.5-3b")
    assert "output.weight" not in tied and tied["token_embd.weight"] == QType.Q6_K
    moe = _types("qwen3-30b-a3b")  # 48 layers; experts by layer as llama-quantize parses
    assert _layers_of(moe, "ffn_down_exps.weight", QType.Q6_K) == [
        i for i in range(48) if i < 6 or i >= 42 or (i - 6) % 3 == 2
    ]
    assert moe["blk.0.ffn_gate_exps.weight"] == QType.Q4_K
    assert moe["blk.0.ffn_gate_inp.weight"] == QType.F32
    assert set(_types("olmoe-1b-7b", "Q8_0").values()) == {QType.Q8_0, QType.F32}
    eight = {p.name: p.qtype for p in shaped_tensors(TINY_SHAPES["tiny-olmoe"], "Q4_K_M")}
    assert eight["blk.3.attn_v.weight"] == eight["blk.3.attn_k.weight"] == QType.Q8_0
    assert eight["blk.3.attn_output.weight"] == QType.Q5_K  # exactly 8 experts (Mixtral)
    odd = {p.name: p.qtype for p in shaped_tensors(TINY_SHAPES["tiny-qwen2"], "Q4_K_M")}
    assert odd["blk.0.ffn_down.weight"] == QType.Q8_0  # rows of 288: Q6_K's fallback
    assert odd["blk.4.ffn_down.weight"] == QType.Q5_0  # Q4_K's (36 layers: 4 is Q4_K)
    assert odd["blk.3.ffn_up.weight"] == QType.Q4_K  # rows of 256


def test_real_shapes_are_the_real_sizes() -> None:
    """The tensor bytes of the real shapes at Q4_K_M: the published files' sizes, less
    their metadata (bartowski's Qwen2.5-7B-Instruct 4.68 GB, Llama-3.1-8B-Instruct
    4.92 GB; Qwen's Qwen3-30B-A3B 18.6 GB)."""
    gb = {
        name: sum(p.nbytes for p in shaped_tensors(s, "Q4_K_M")) / 1e9 for name, s in SHAPES.items()
    }
    assert gb["qwen2.5-7b"] == pytest.approx(4.68, abs=0.02)
    assert gb["llama-3.1-8b"] == pytest.approx(4.91, abs=0.02)
    assert gb["qwen3-30b-a3b"] == pytest.approx(18.55, abs=0.1)
    # gpt-oss-20b as MXFP4: 24 x 32 experts x 3 x 2880^2 weights at 17 bytes a 32, the
    # rest (two 201088 x 2880 tables, attention) at Q8_0's 34.
    mxfp4 = {p.name: p for p in shaped_tensors(SHAPES["gpt-oss-20b"], "MXFP4")}
    experts = sum(p.nbytes for n, p in mxfp4.items() if n.endswith("_exps.weight"))
    assert experts == 24 * 32 * 3 * 2880 * 2880 // 32 * 17
    assert mxfp4["output.weight"].qtype == mxfp4["blk.5.attn_q.weight"].qtype == QType.Q8_0
    assert sum(p.nbytes for p in mxfp4.values()) / 1e9 == pytest.approx(12.05, abs=0.05)


@pytest.mark.usefixtures("tiny_shapes")
def test_cli(tmp_path: Path, tiny_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shaped = tmp_path / "shaped.gguf"
    random_gguf.main(
        ["shaped", "--shape", "tiny-olmoe", "--out", str(shaped), "--layers", "2",
         "--mix", "Q8_0", "--tokenizer", str(tiny_tokenizer)]
    )  # fmt: skip
    reader = gguf.GGUFReader(shaped)
    assert _fields(reader)["olmoe.block_count"] == 2
    assert {t.tensor_type for t in reader.tensors} == {QType.Q8_0, QType.F32}
    _build("mixtral", tmp_path / "hf")
    converted = tmp_path / "converted.gguf"
    random_gguf.main(
        ["convert", str(tmp_path / "hf"), str(converted), "--type", "Q8_0",
         "--tokenizer", str(tiny_tokenizer)]
    )  # fmt: skip
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(converted).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == QType.Q8_0
    assert types["blk.0.ffn_gate_inp.weight"] == QType.F32
    assert "wrote" in capsys.readouterr().out
