"""The packaged Gemma-3-270M: sluice's greedy output equals transformers' (fp32, the same
GGUF dequantized) token for token, on prompts shorter and longer than its 512-token
window, in one piece, chunked, and after a prefix-cache hit; its own quantized weights
load and run. Slow (transformers' GGUF load takes ~45 s): `make test-slow`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
SHORT = ["The capital of France is", "def fibonacci(n):"]


def long_prompt() -> str:
    """About 800 tokens of varied prose: longer than the local layers' window."""
    animals = ["fox", "heron", "badger", "otter", "lynx", "wren", "hare", "stoat"]
    places = ["river", "hill", "orchard", "harbour", "meadow", "forest", "village"]
    lines = [
        f"On day {i}, the {animals[i % 8]} walked from the {places[i % 7]} to the "
        f"{places[(3 * i + 1) % 7]} and counted {i * 7 % 23} stones along the way."
        for i in range(40)
    ]
    return " ".join(lines) + " At the end of the journey, the animals"


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    from sluice.loader.resolve import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path(MODEL)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf_gemma(gemma_path: Path) -> tuple[Any, Any]:
    import accelerate  # noqa: F401  (transformers needs it)
    import transformers

    directory, name = str(gemma_path.parent), gemma_path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    )
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def gemma_fp32() -> LLM:
    return LLM(model=MODEL, dtype="float32", kv_cache_memory=0.5, max_num_batched_tokens=128)


def reference(hf: tuple[Any, Any], ids: list[int], n: int = 32) -> list[int]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return list(out[0, len(ids) :].tolist())


def test_tokenizer_matches_transformers(gemma_fp32: LLM, hf_gemma: tuple[Any, Any]) -> None:
    _, tokenizer = hf_gemma
    for text in [*SHORT, long_prompt()]:
        assert gemma_fp32.engine.encode_prompt(text) == tokenizer(text)["input_ids"]


def test_greedy_matches_transformers(gemma_fp32: LLM, hf_gemma: tuple[Any, Any]) -> None:
    """Short prompts, and one past the window prefilled in 128-token chunks."""
    _, tokenizer = hf_gemma
    batch = [tokenizer(p)["input_ids"] for p in [*SHORT, long_prompt()]]
    assert len(batch[-1]) > 512 + 128
    sp = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    outs = gemma_fp32.generate(batch, sp, use_tqdm=False)
    for ids, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == reference(hf_gemma, ids)


def test_prefix_cache_hit_past_the_window(gemma_fp32: LLM, hf_gemma: tuple[Any, Any]) -> None:
    _, tokenizer = hf_gemma
    shared = tokenizer(long_prompt())["input_ids"]
    ids = [*shared, *tokenizer(" Then the otter said", add_special_tokens=False)["input_ids"]]
    sp = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    gemma_fp32.generate([shared], sp, use_tqdm=False)
    before = gemma_fp32.engine.kv.num_hit_tokens
    out = gemma_fp32.generate([ids], sp, use_tqdm=False)[0]
    assert gemma_fp32.engine.kv.num_hit_tokens - before > 512
    assert out.outputs[0].token_ids == reference(hf_gemma, ids, 24)


def test_quantized_weights_load_and_agree(gemma_fp32: LLM, hf_gemma: tuple[Any, Any]) -> None:
    """The default load keeps the GGUF's blocks (Q4_K, Q5_0, Q6_K, Q8_0) quantized."""
    llm = LLM(model=MODEL, kv_cache_memory=0.25)
    assert llm.engine.quantization == "gguf"
    assert llm.engine.runner.weight_bytes() < 0.5 * 268_098_176 * 4  # far below fp32
    sp = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    _, tokenizer = hf_gemma
    ids = tokenizer(SHORT[0])["input_ids"]
    first = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert first[:2] == reference(hf_gemma, ids, 2)


def test_hf_directory_matches_transformers(
    hf_gemma: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same model saved by transformers as an HF directory (safetensors, norms as
    offsets from 1, Gemma3TextConfig) loads too and decodes the same tokens."""
    from safetensors.torch import save_file

    model, tokenizer = hf_gemma
    directory = tmp_path_factory.mktemp("gemma-hf")
    # transformers will not save_pretrained a model it loaded from a GGUF: write the
    # same files by hand (the tied output head is the embedding, saved once).
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, directory / "model.safetensors")
    config = model.config.to_dict()
    config["architectures"] = ["Gemma3ForCausalLM"]
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(directory)
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory=0.25)
    c = llm.engine.model_config
    assert (c.architecture, c.sliding_window, c.rope_local_theta) == ("gemma3", 512, 10_000.0)
    assert c.sliding_window_layers == tuple(i for i in range(18) if (i + 1) % 6)
    ids = tokenizer(SHORT[1])["input_ids"]
    sp = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(hf_gemma, ids)


def test_local_pool_holds_only_the_window(gemma_fp32: LLM) -> None:
    """The split cache: decoding past the 512-token window, the 15 local layers hold
    ceil(512 / 16) + 1 blocks, the 3 global ones the whole sequence; all go back."""
    engine = gemma_fp32.engine
    ids = engine.encode_prompt(long_prompt())
    engine.add_request("held", ids, SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
    held: list[tuple[int, int, int]] = []
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            if req.num_computed_tokens > len(ids):  # decoding
                kv = engine.kv
                held.append(
                    (
                        req.num_computed_tokens,
                        kv.num_held_blocks(req, 0),
                        kv.num_held_blocks(req, 1),
                    )
                )
    assert held and engine.kv.local_pool is not None
    for computed, global_blocks, local_blocks in held:
        assert global_blocks == -(-computed // 16)  # the whole sequence
        assert local_blocks <= 512 // 16 + 1
    for group in engine.kv.groups:
        assert group.pool.num_free == group.pool.num_blocks
