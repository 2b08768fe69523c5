"""Sliding-window models with random weights: Gemma 3 (local and global layers) and
Mistral with a window on every layer. sluice's greedy output must equal transformers'
token for token (fp32) on prompts longer than the window, computed in one piece, in
small chunks (chunked prefill), and again after a prefix-cache hit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.loader import tokenizer_from_gguf

transformers = pytest.importorskip("transformers")

WINDOW = 16

COMMON: dict[str, Any] = dict(
    vocab_size=49152,  # the SmolLM2 tokenizer is reused for detokenization
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,  # peaky logits: no near-ties for greedy to trip on
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def gemma3() -> Any:
    # Layers 0, 1, 3, 4 local, 2 and 5 global (pattern 3); a score scale and a
    # softcap of their own, and a rope base per layer kind.
    return transformers.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=6,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=48,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
    )


def mistral() -> Any:
    return transformers.MistralConfig(
        **COMMON, num_hidden_layers=3, sliding_window=WINDOW, tie_word_embeddings=False
    )


CONFIGS: dict[str, Callable[[], Any]] = {"gemma3": gemma3, "mistral": mistral}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> tuple[str, Path, Any]:
    kind = request.param
    directory = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        if kind == "gemma3":  # norms start at 0 (scale 1): make (1 + weight) matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)
        # A smaller embedding, so that the token's own embedding does not drown the
        # attention output in the residual stream: without it, Gemma's greedy tokens
        # came out the same with the window switched off, and Mistral never repeated
        # itself (nothing for the speculative test's n-gram proposer to draft).
        model.model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(directory)
    tokenizer_from_gguf(smollm2_path).save(directory)
    return kind, directory, model


def reference(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    # Shorter than the window, a little and much longer (several blocks fall out).
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (7, 23, 61)]


@pytest.mark.parametrize("chunk", [512, 5])  # whole prompts; 5-token chunks
def test_greedy_matches_transformers(model_dir: tuple[str, Path, Any], chunk: int) -> None:
    kind, directory, model = model_dir
    llm = LLM(
        model=str(directory),
        dtype="float32",
        kv_cache_memory=0.02,
        max_num_batched_tokens=chunk,
        block_size=4,
    )
    config = llm.engine.model_config
    assert config.architecture == ("gemma3" if kind == "gemma3" else "llama")
    assert config.sliding_window == WINDOW
    sp = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    batch = prompts()
    outs = llm.generate(batch, sp, use_tqdm=False)
    for ids, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == reference(model, ids, 40)


def test_prefix_cache_hit_matches_transformers(model_dir: tuple[str, Path, Any]) -> None:
    """A second prompt sharing a long prefix starts from cached blocks, some of them
    outside the window of its first computed token."""
    _, directory, model = model_dir
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory=0.02, block_size=4)
    first = prompts()[2]
    second = [*first[:52], 7, 8, 9, 10, 11]
    sp = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
    llm.generate([first], sp, use_tqdm=False)
    out = llm.generate([second], sp, use_tqdm=False)[0]
    assert llm.engine.kv.num_hit_tokens >= 48
    assert out.outputs[0].token_ids == reference(model, second, 20)


def test_blocks_held_follow_the_window(model_dir: tuple[str, Path, Any]) -> None:
    """Mistral (every layer windowed) holds only the blocks its window still sees;
    Gemma 3 (global layers read everything) keeps the whole sequence."""
    kind, directory, _ = model_dir
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory=0.02, block_size=4)
    engine = llm.engine
    engine.add_request("long", prompts()[2], SamplingParams(temperature=0, max_tokens=60))
    most = 0  # blocks held while decoding (the 61-token prompt is one chunk)
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            if req.num_computed_tokens > 61:
                most = max(most, engine.kv.num_held_blocks(req))
    if kind == "mistral":
        # The window's 16 positions span at most 5 blocks, plus one being filled.
        assert engine.kv.window == WINDOW and most <= 6
    else:
        assert engine.kv.window is None and most >= (61 + 59) // 4


def test_speculative_decoding_matches_transformers(
    model_dir: tuple[str, Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verifying drafts (several queries a sequence in the paged kernel, each with its
    own window) and rolling back rejected ones, with blocks released behind the window.
    The drafts are transformers' own next tokens with the last one wrong, so every
    verification accepts some and rejects one (a random model gives an n-gram
    proposer nothing to draft)."""
    _, directory, model = model_dir
    llm = LLM(
        model=str(directory),
        dtype="float32",
        kv_cache_memory=0.02,
        block_size=4,
        speculative_method="ngram",
        num_speculative_tokens=4,
    )
    ids = prompts()[2]
    ref = reference(model, ids, 60)

    def propose(requests: list[Any], num_tokens: list[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(requests, num_tokens, strict=True):
            done = req.num_output_tokens
            run = ref[done : done + k]
            drafts.append([*run[:-1], (run[-1] + 1) % 49152] if run else [])
        return drafts

    assert llm.engine.speculator is not None
    monkeypatch.setattr(llm.engine.speculator.proposer, "propose", propose)
    sp = SamplingParams(temperature=0, max_tokens=60, min_tokens=60)
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    assert out.outputs[0].token_ids == ref
