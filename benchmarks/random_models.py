"""Small random-weight models of the architectures sluice runs, built with transformers.

sluice's output on them is compared with transformers' on the same weights, token for
token (tests/test_architectures.py on CPU, benchmarks/cuda_check.py on a GPU, where no
model file can travel). Each is saved as a Hugging Face directory (config.json and
safetensors); the caller adds a tokenizer. Random LoRA adapters for a model's shape
too (benchmarks/lora.py, tests/test_decode_stack.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sluice.config import ModelConfig
from sluice.core.choices import LORA_MODEL_TARGETS, LORA_TARGETS
from sluice.loader.lora import target_shape

# Three layers, GQA 4/2, SmolLM2's vocabulary (its tokenizer detokenizes the output).
SMALL: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,  # peaky logits: no near-ties for greedy to trip on
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

KINDS = ("llama", "llama-rope3", "mistral-nemo", "granite", "phi3", "qwen2", "qwen3")
# Built like KINDS, tested on their own: which LongRoPE factors apply depends on the
# context served (tests/test_architectures.py).
ROPE_KINDS = ("phi3-longrope", "phi4-mini")
# The architecture sluice runs each kind as (Mistral's checkpoints load as Llama).
ARCHITECTURE = {"mistral-nemo": "llama"}
# Mixture-of-Experts: 8 experts of 64 units, a few chosen per token, as each family
# routes (Qwen3-MoE renormalizes its top k, as the released models do; Qwen2-MoE and
# OLMoE do not; Mixtral always does).
MOE_KINDS = (
    "mixtral",
    "qwen2moe",
    "qwen3moe",
    "olmoe",
    "granitemoe",
    "granitemoeshared",
    "gpt_oss",
)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
# gpt-oss's YaRN (factor 32, beta 32/1, not truncated) over a trained context of 32
# positions: the tests' prompts run past it.
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,
}
# Granite 3.x's four scalings, of the size the released models use (8B: 12, 0.22,
# 1/128, 16), for Granite and Granite-MoE.
_GRANITE_SCALINGS = dict(
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.03,
    logits_scaling=4.0,
)


def hf_config(kind: str, shape: dict[str, Any]) -> Any:
    """The transformers config of `kind` (one of KINDS) with `shape`'s sizes."""
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**{"rope_theta": 10000.0, **shape})
    if kind == "llama-rope3":
        return transformers.LlamaConfig(**shape, rope_parameters=_LLAMA3_ROPE)
    if kind == "mistral-nemo":  # head_dim set apart from hidden / heads (Nemo: 128 of 160)
        hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
        return transformers.MistralConfig(
            **shape, head_dim=hidden // heads + 16, sliding_window=None, rope_theta=1e6
        )
    if kind == "granite":
        return transformers.GraniteConfig(**shape, rope_theta=1e4, **_GRANITE_SCALINGS)
    if kind == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint
        return transformers.Phi3Config(
            **shape, rope_theta=1e4, sliding_window=None, pad_token_id=shape["eos_token_id"]
        )
    if kind in ("phi3-longrope", "phi4-mini"):  # Phi-3.5-mini's scaling: trained on 64,
        # extended 8x; Phi-4-mini's also turns only 3/4 of each head
        partial = 0.75 if kind == "phi4-mini" else 1.0
        pairs = int(shape["hidden_size"] // shape["num_attention_heads"] * partial) // 2
        rope = {
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [1.0 + 0.5 * i for i in range(pairs)],
        }
        return transformers.Phi3Config(
            **{**shape, "max_position_embeddings": 512},
            original_max_position_embeddings=64,
            rope_parameters=rope,
            partial_rotary_factor=partial,
            sliding_window=None,
            pad_token_id=shape["eos_token_id"],  # Phi-3's own (32000) is past small vocabularies
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**{**shape, "rope_theta": 1000000.0})
    if kind == "qwen3":
        return transformers.Qwen3Config(**{**shape, "rope_theta": 1000000.0}, head_dim=48)
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **shape, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6
        )
    if kind == "qwen2moe":
        return transformers.Qwen2MoeConfig(
            **{**shape, **_MOE, "rope_theta": 1e6}, shared_expert_intermediate_size=96
        )
    if kind == "qwen3moe":
        moe = {**_MOE, "num_experts_per_tok": 3}
        return transformers.Qwen3MoeConfig(
            **{**shape, **moe}, head_dim=48, norm_topk_prob=True, rope_theta=1e6
        )
    if kind == "olmoe":
        return transformers.OlmoeConfig(**{**shape, **_MOE, "intermediate_size": 64})
    if kind == "granitemoe":  # its experts are intermediate_size units
        return transformers.GraniteMoeConfig(
            **{**shape, "intermediate_size": 64},
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=1e4,
            **_GRANITE_SCALINGS,
        )
    if kind == "granitemoeshared":  # and a shared expert, added ungated
        return transformers.GraniteMoeSharedConfig(
            **{**shape, "intermediate_size": 64},
            num_local_experts=8,
            num_experts_per_tok=2,
            shared_intermediate_size=96,
            rope_theta=1e4,
            **_GRANITE_SCALINGS,
        )
    if kind == "gpt_oss":  # a window and a YaRN context both short enough to matter
        return transformers.GptOssConfig(
            **{**shape, "intermediate_size": 64},
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=32,
            sliding_window=16,
            rope_parameters=_GPT_OSS_ROPE,
        )
    raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS + ROPE_KINDS + MOE_KINDS)}")


def build_model(kind: str, shape: dict[str, Any], directory: Path) -> Any:
    """A seeded random-weight model of `kind`, saved to `directory`; returns it (fp32)."""
    import transformers

    torch.manual_seed(0)
    config = hf_config(kind, shape)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if kind in ("qwen2", "qwen2moe"):  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if kind == "gpt_oss":  # biases and sinks as large as the weights' scale
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0, 0.5)
    model.save_pretrained(directory)
    return model


_PEFT_PREFIX = "base_model.model.model.layers"


def write_random_adapter(
    config: ModelConfig,
    rank: int,
    seed: int,
    out: Path,
    b_scale: float = 0.01,
    model_level: bool = False,
) -> Path:
    """A random PEFT LoRA adapter folder of rank `rank` on every projection of a model
    of `config`'s shape (model_level: the token embedding and the head too, named as
    peft names them), in fp16. B's entries have standard deviation `b_scale`: the
    default keeps the output a model's, not noise (speed does not depend on what an
    adapter learned); a larger one makes the adapter change the tokens."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in LORA_TARGETS:
            fan_in, fan_out = target_shape(config, target)
            part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"{_PEFT_PREFIX}.{layer}.{part}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * b_scale
    if model_level:  # A's rows are a token's (embedding) or the hidden state's (head)
        vocab, hidden = config.vocab_size, config.hidden_size
        embed, head = "base_model.model.model.embed_tokens", "base_model.model.lm_head"
        tensors[f"{embed}.lora_embedding_A"] = torch.randn(rank, vocab, generator=g)
        tensors[f"{embed}.lora_embedding_B"] = torch.randn(hidden, rank, generator=g) * b_scale
        tensors[f"{head}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) / hidden**0.5
        tensors[f"{head}.lora_B.weight"] = torch.randn(vocab, rank, generator=g) * b_scale
    targets = [*LORA_TARGETS, *(LORA_MODEL_TARGETS if model_level else ())]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.half() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    config_json = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": targets,
        "bias": "none",
        "base_model_name_or_path": config.name,
    }
    (out / "adapter_config.json").write_text(json.dumps(config_json))
    return out
