"""Small random-weight Llama (also with Llama 3's rope scaling), Mistral-Nemo (a head
size apart from hidden / heads), Qwen2 and Qwen3 models: sluice's greedy output must
equal transformers' on the same weights, token for token (fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.random_models import ARCHITECTURE, KINDS, SMALL, build_model
from sluice import LLM, SamplingParams
from sluice.loader import tokenizer_from_gguf


def build(kind: str, directory: Path, smollm2_path: Path) -> torch.nn.Module:
    model = build_model(kind, SMALL, directory)
    tokenizer_from_gguf(smollm2_path).save(directory)
    return model


@pytest.mark.parametrize(
    ("kind", "compile"),
    # torch.compile once, on the plainest architecture, in the slow run (`make test-slow`):
    # compiling costs tens of seconds, and the default run compiles a model once already
    # (test_compiled_bf16_matches_eager, below).
    [(kind, False) for kind in sorted(KINDS)]
    + [pytest.param("llama", True, marks=pytest.mark.slow)],
)
def test_random_model_matches_transformers(
    kind: str, compile: bool, tmp_path: Path, smollm2_path: Path
) -> None:
    model = build(kind, tmp_path, smollm2_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 23, 40, 70)]
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        kv_cache_memory=0.02,
        max_num_batched_tokens=32,
        block_size=8,
        compile=compile,
    )
    arch = ARCHITECTURE.get(kind, kind.split("-")[0])
    assert llm.engine.model_config.architecture == arch
    sp = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    with torch.no_grad():
        for ids, out in zip(prompts, outs, strict=True):
            ref = model.generate(
                torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False
            )[0, len(ids) :].tolist()
            assert out.outputs[0].token_ids == ref


def test_compiled_bf16_matches_eager(tmp_path: Path, smollm2_path: Path) -> None:
    """bf16 dense weights on CPU are prepacked for oneDNN where the CPU has AVX-512;
    torch.compile used to fail lowering that call (it expects weights it froze itself).
    The call is opaque to the compiler now, and the compiled model scores a prompt as
    the eager one does, to bf16's rounding (these random weights give logits of
    std ~3, so two bf16 paths may swap near-tied greedy picks: logprobs, not tokens)."""
    build("llama", tmp_path, smollm2_path)
    prompt = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scores = {}
    for compile in (False, True):
        llm = LLM(
            model=str(tmp_path),
            dtype="bfloat16",
            quantization="none",
            kv_cache_memory=0.02,
            block_size=8,
            compile=compile,
        )
        (out,) = llm.generate(prompt, sp, use_tqdm=False)
        assert out.prompt_logprobs is not None
        scores[compile] = torch.tensor(
            [e[t].logprob for t, e in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)]
        )
    diff = (scores[True] - scores[False]).abs()
    print(f"compiled - eager prompt logprobs: mean {diff.mean():.4f}, max {diff.max():.4f}")
    assert diff.mean() < 0.1 and diff.max() < 0.5


def test_granite_scales_its_logits(tmp_path: Path, smollm2_path: Path) -> None:
    """Greedy tokens cannot see Granite's logits_scaling (argmax is unchanged by it):
    the prompt's logprobs equal transformers' log-softmax of its scaled logits."""
    model = build("granite", tmp_path, smollm2_path)
    prompt = torch.randint(3, 49152, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=0.02, block_size=8)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate(prompt, sp, use_tqdm=False)
    assert out.prompt_logprobs is not None
    got = torch.tensor(
        [e[t].logprob for t, e in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)]
    )
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["phi3-longrope", "phi4-mini"])
def test_phi3_longrope_matches_transformers(kind: str, tmp_path: Path, smollm2_path: Path) -> None:
    """Phi-3.5's LongRoPE (trained on 64 positions here, extended to 512): serving a
    context inside the trained one takes the short factors, one past it the long
    factors, for every position (llama.cpp's rule); transformers picks per forward by
    the sequence's length, so both agree on sequences that stay inside 64 tokens and on
    ones that start past it. The attention factor (from 512 / 64) applies to both.
    Phi-4-mini's rope turns 3/4 of each head (24 of 32 dims here), the attention factor
    scaling those dims only."""
    model = build(kind, tmp_path, smollm2_path)
    gen = torch.Generator().manual_seed(4)
    cases = {64: (10, 30), 512: (80, 150)}  # max_model_len: prompt lengths
    for max_model_len, lengths in cases.items():
        llm = LLM(
            model=str(tmp_path),
            dtype="float32",
            kv_cache_memory=0.02,
            block_size=8,
            max_model_len=max_model_len,
        )
        n = 24 if max_model_len == 512 else 64 - max(lengths)
        sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
        prompts = [torch.randint(3, 49152, (k,), generator=gen).tolist() for k in lengths]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        with torch.no_grad():
            for ids, out in zip(prompts, outs, strict=True):
                ref = model.generate(
                    torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
                )[0, len(ids) :].tolist()
                assert out.outputs[0].token_ids == ref, (max_model_len, len(ids))


def test_phi3_config_window_and_partial_rotary() -> None:
    """Phi-3-mini-4k's window (2047 of 4096) applies; Phi-3.5's (262,144 of 131,072)
    never could and is dropped (the fused decode stack then stays on); Phi-4-mini's
    partial rotary factor gives the rotary dims, and one that cannot be is refused."""
    from sluice.loader.hf_loader import config_from_hf

    base = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    }
    mini = config_from_hf({**base, "max_position_embeddings": 4096, "sliding_window": 2047})
    assert mini.sliding_window == 2047
    long = config_from_hf({**base, "max_position_embeddings": 131072, "sliding_window": 262144})
    assert long.sliding_window is None
    assert config_from_hf({**base, "partial_rotary_factor": 0.75}).rotary_dim == 24
    assert config_from_hf({**base, "partial_rotary_factor": 1.0}).rotary_dim is None
    for bad in (1.5, 0.72):  # more dims than the head; 23 of 32, odd
        with pytest.raises(ValueError, match="rotary dims"):
            config_from_hf({**base, "partial_rotary_factor": bad})


@pytest.mark.parametrize(
    "rope",
    [
        # gpt-oss's: not truncated, the attention factor from the factor alone.
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        # Qwen's long-context YaRN: truncated (the default), transformers' beta defaults.
        {"factor": 4.0},
        # DeepSeek's: an attention factor from the ratio of two mscales.
        {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32.0},
    ],
)
def test_yarn_rope_matches_transformers(rope: dict[str, Any]) -> None:
    """cos and sin of YaRN rope equal transformers' (its inverse frequencies times its
    attention factor) at positions inside and far past the trained context."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sluice.layers.rotary import RotaryEmbedding

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **rope}
    params["original_max_position_embeddings"] = 4096
    config = transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072,
        rope_parameters=params,
    )  # fmt: skip
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rotary = RotaryEmbedding(64, 8192, 150000.0, scaling, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 1, 17, 4095, 4096, 6000])
    cos, sin = rotary.lookup(positions)
    angles = positions[:, None].double() * inv_freq.double()[None, :]
    # transformers' frequencies are fp32 (ours fp64): 6000 turns of the fastest pair
    # differ by ~4e-4 radians.
    assert torch.allclose(cos[:, 0], (angles.cos() * factor).float(), atol=1e-3, rtol=0)
    assert torch.allclose(sin[:, 0], (angles.sin() * factor).float(), atol=1e-3, rtol=0)
    assert factor != 1.0
