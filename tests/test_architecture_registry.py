"""Every architecture is registered once (sluice/architectures/): each registration has
what a model needs, the loaders and the model registry find families through it, an
unregistered name is refused with the one clear error, and the engine asks it, not
the name, what a family can do.

The greedy comparisons with transformers (tests/test_architectures.py,
tests/test_sliding_window.py) check that each family's reading is right; these check
the registry itself and the Gemma 3 GGUF reading no packaged model covers here."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from sluice.architectures import REGISTRY, spec_for_gguf, spec_for_hf, spec_of
from sluice.config import ModelConfig
from sluice.core.choices import ARCHITECTURES
from sluice.core.errors import ConfigError
from sluice.engine.speculative.eagle_load import check_head
from sluice.loader import gguf_loader
from sluice.loader.gguf_metadata import GGUFMetadata
from sluice.loader.hf_loader import config_from_hf
from sluice.models import ENCODER_CLASSES, MODEL_CLASSES, encoder_class, model_class
from sluice.runner.model_runner import check_tensor_parallel


def _config(arch: str) -> ModelConfig:
    return ModelConfig(arch, 10, 8, 16, 1, 2, 2, 4)  # type: ignore[arg-type]


DECODERS = [a for a in ARCHITECTURES if not REGISTRY[a].encoder]
ENCODERS = [a for a in ARCHITECTURES if REGISTRY[a].encoder]


@pytest.mark.parametrize("arch", ENCODERS)
def test_every_encoder_has_its_class_and_checkpoint_names(arch: str) -> None:
    spec = REGISTRY[arch]
    assert spec.name == arch and spec.title and not spec.gguf_names
    assert ENCODER_CLASSES[spec.model] is encoder_class(_config(arch))
    assert spec.hf_classes and all(spec_for_hf(n) is spec for n in spec.hf_classes)
    # Neither tensor parallelism nor an EAGLE head: no decoder layers to split or follow.
    assert not spec.tensor_parallel and not spec.eagle_head


@pytest.mark.parametrize("arch", DECODERS)
def test_every_architecture_has_what_a_model_needs(arch: str) -> None:
    spec = REGISTRY[arch]
    assert spec.name == arch and spec.title
    assert spec.model in MODEL_CLASSES
    assert model_class(_config(arch)) is MODEL_CLASSES[spec.model]
    assert spec.gguf_names and all(spec_for_gguf(n) is spec for n in spec.gguf_names)
    assert spec.hf_classes and all(spec_for_hf(n) is spec for n in spec.hf_classes)
    assert spec_of(arch) is spec
    # The layer tensors every decoder loads have GGUF names.
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
        ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
    ]:
        assert spec.hf_tensor_name(gguf_name) == hf_name
    assert spec.hf_tensor_name("blk.0.no_such_tensor.weight") is None


def test_names_are_claimed_once_and_every_model_class_is_used() -> None:
    gguf_names = [n for spec in REGISTRY.values() for n in spec.gguf_names]
    hf_classes = [n for spec in REGISTRY.values() for n in spec.hf_classes]
    assert len(gguf_names) == len(set(gguf_names))
    assert len(hf_classes) == len(set(hf_classes))
    decoders = {spec.model for spec in REGISTRY.values() if not spec.encoder}
    assert decoders == set(MODEL_CLASSES)
    assert {spec.model for spec in REGISTRY.values() if spec.encoder} == set(ENCODER_CLASSES)


def test_an_unregistered_name_is_refused_naming_what_is_supported() -> None:
    moe = "qwen2moe, qwen3moe, olmoe, granitemoe"
    dense = "llama, qwen2, qwen3, gemma3, granite, phi3"
    gguf_names = f"{dense}, {moe}, gpt-oss"
    hf_classes = (
        "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, Gemma3ForCausalLM, Gemma3TextModel, GraniteForCausalLM, "
        "Phi3ForCausalLM, Qwen2MoeForCausalLM, "
        "Qwen3MoeForCausalLM, OlmoeForCausalLM, GraniteMoeForCausalLM, "
        "GraniteMoeSharedForCausalLM, GptOssForCausalLM, BertModel, BertForMaskedLM, MPNetModel, "
        "MPNetForMaskedLM"
    )
    for lookup, name, known in [
        (spec_for_gguf, "gpt2", gguf_names),
        (spec_of, "gpt2", f"{dense}, {moe}, gpt_oss, bert, mpnet"),
        (spec_for_hf, "PhiForCausalLM", hf_classes),
    ]:
        with pytest.raises(ValueError) as err:
            lookup(name)
        assert (
            str(err.value) == f"unsupported model architecture {name!r}; sluice supports: {known}"
        )
    # Before any key of the config is read.
    with pytest.raises(ValueError, match="unsupported model architecture 'PhiForCausalLM'"):
        config_from_hf({"architectures": ["PhiForCausalLM"]})


def test_capabilities_come_from_the_registration() -> None:
    for arch, spec in REGISTRY.items():
        config = _config(arch)
        if spec.tensor_parallel:
            check_tensor_parallel(config, 2)
        else:
            with pytest.raises(ConfigError, match=f"does not run {spec.title} models yet"):
                check_tensor_parallel(config, 2)
        if not spec.eagle_head:
            with pytest.raises(ConfigError, match="runs on dense Llama-family targets"):
                check_head(Path("head.safetensors"), {}, config)
    assert not REGISTRY["gemma3"].tensor_parallel and not REGISTRY["gemma3"].eagle_head
    # Mixtral is a Llama with experts: split by experts only, and not drafted for.
    mixtral = ModelConfig(
        "llama",
        10,
        8,
        16,
        1,
        2,
        2,
        4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    with pytest.raises(ConfigError, match="set enable_expert_parallel"):
        check_tensor_parallel(mixtral, 2)
    check_tensor_parallel(mixtral, 2, expert_parallel=True)  # 4 experts: 2 a rank
    with pytest.raises(ConfigError, match="must divide the model's 4 experts"):
        check_tensor_parallel(mixtral, 3, expert_parallel=True)
    with pytest.raises(ConfigError, match="runs on dense Llama-family targets"):
        check_head(Path("head.safetensors"), {}, mixtral)


def _tiny_gemma3(path: Path, layers: int) -> dict[str, np.ndarray]:
    """A Gemma 3 GGUF as llama.cpp writes one: metadata and layer 0's norms and q."""
    rng = np.random.default_rng(0)
    hidden, heads, head_dim, vocab = 64, 4, 8, 32
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(128)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(512)
    stored = {
        "token_embd.weight": rng.standard_normal((vocab, hidden)),
        "output_norm.weight": rng.standard_normal(hidden),
        "blk.0.attn_q.weight": rng.standard_normal((heads * head_dim, hidden)),
        "blk.0.attn_q_norm.weight": rng.standard_normal(head_dim),
        "blk.0.attn_norm.weight": rng.standard_normal(hidden),
        "blk.0.post_attention_norm.weight": rng.standard_normal(hidden),
        "blk.0.ffn_norm.weight": rng.standard_normal(hidden),
        "blk.0.post_ffw_norm.weight": rng.standard_normal(hidden),
    }
    stored = {k: v.astype(np.float32) for k, v in stored.items()}
    for name, value in stored.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def test_gemma3_gguf_config_and_weights(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gemma3.gguf"
    stored = _tiny_gemma3(path, layers=12)
    meta = GGUFMetadata.of(path)
    c = gguf_loader.config_from_gguf(meta, name="tiny")
    assert (c.architecture, c.num_layers, c.head_dim, c.num_kv_heads) == ("gemma3", 12, 8, 1)
    assert (c.sliding_window, c.rope_local_theta, c.rope_theta) == (512, 10_000.0, 1e6)
    assert c.sliding_window_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # every 6th global
    assert c.query_pre_attn_scalar == 8.0  # head_dim
    assert c.qk_norm and not c.attention_bias and c.tie_word_embeddings
    assert c.hidden_act == "gelu_pytorch_tanh" and c.final_logit_softcapping is None
    assert c.vocab_size == 32 and c.name == "tiny"

    entries = gguf_loader.tensor_entries(meta)
    tensors = gguf_loader.tensors_from_gguf(path, entries, c, keep_quantized=False)
    hf_names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
        "blk.0.post_ffw_norm.weight": "model.layers.0.post_feedforward_layernorm.weight",
    }
    assert sorted(tensors) == sorted(hf_names.values())
    for gguf_name, hf_name in hf_names.items():
        # Norm scales are stored with the 1 added; q stays in its rows' order (no
        # llama permutation).
        want = torch.from_numpy(stored[gguf_name])
        if hf_name.endswith("norm.weight"):
            want = want - 1.0
        torch.testing.assert_close(tensors[hf_name], want, rtol=0, atol=0)


def test_gemma3_gguf_62_layers_scale_scores_by_hidden_per_head(tmp_path: Path) -> None:
    # The 27B: query_pre_attn_scalar is hidden / heads (16 here), not head_dim (8).
    _tiny_gemma3(tmp_path / "deep.gguf", layers=62)
    c = gguf_loader.config_from_gguf(GGUFMetadata.of(tmp_path / "deep.gguf"))
    assert c.query_pre_attn_scalar == 16.0
