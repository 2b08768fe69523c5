"""The packaged Gemma-3-270M: sluice's greedy output equals transformers' (fp32, the same
GGUF dequantized) token for token, on prompts shorter and longer than its 512-token
window, in one piece, chunked, and after a prefix-cache hit; its own quantized weights
load and run.

transformers' GGUF load takes ~45 s, so the default run checks against its answers as
recorded in tests/data/gemma3_reference.json (token ids of each prompt and the greedy
continuations, for this exact file: its SHA-256 is checked); the slow tests (`make
test-slow`) load transformers and fail when the recording differs from what it gives
now. `python -m tests.test_gemma3` writes the recording again."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import transformers_from_gguf

from sluice import LLM, SamplingParams

MODEL = "gemma-3-270m"
SHORT = ["The capital of France is", "def fibonacci(n):"]
REFERENCE = Path(__file__).parent / "data" / "gemma3_reference.json"
GREEDY_TOKENS = 32
HIT_TOKENS = 24  # after the prefix-cache hit
HIT_SUFFIX = " Then the otter said"


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
    from sluice.loader.resolve import resolve_model_path

    return resolve_model_path(MODEL)  # `make install` brings it: a missing one fails


@pytest.fixture(scope="module")
def hf_gemma(gemma_path: Path) -> tuple[Any, Any]:
    return transformers_from_gguf(gemma_path)


@pytest.fixture(scope="module")
def gemma_fp32() -> LLM:
    return LLM(model=MODEL, dtype="float32", kv_cache_memory=0.5, max_num_batched_tokens=128)


def reference(hf: tuple[Any, Any], ids: list[int], n: int = GREEDY_TOKENS) -> list[int]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return list(out[0, len(ids) :].tolist())


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record(hf: tuple[Any, Any], path: Path) -> dict[str, Any]:
    """transformers' token ids and greedy continuations of every prompt the tests use."""
    _, tokenizer = hf
    texts = {"short0": SHORT[0], "short1": SHORT[1], "long": long_prompt()}
    cases = {name: {"text": t, "ids": tokenizer(t)["input_ids"]} for name, t in texts.items()}
    for case in cases.values():
        case["greedy"] = reference(hf, case["ids"])
    suffix = tokenizer(HIT_SUFFIX, add_special_tokens=False)["input_ids"]
    hit = [*cases["long"]["ids"], *suffix]
    cases["prefix_hit"] = {"ids": hit, "greedy": reference(hf, hit, HIT_TOKENS)}
    import transformers

    return {"model_file_sha256": sha256(path), "transformers": transformers.__version__,
            "cases": cases}  # fmt: skip


@pytest.fixture(scope="module")
def recorded(gemma_path: Path) -> dict[str, Any]:
    """The recording, checked to be of this file."""
    data: dict[str, Any] = json.loads(REFERENCE.read_text())
    assert data["model_file_sha256"] == sha256(gemma_path), (
        f"{gemma_path} is not the file {REFERENCE.name} was recorded from"
    )
    cases: dict[str, Any] = data["cases"]
    return cases


def test_tokenizer_matches_transformers(gemma_fp32: LLM, recorded: dict[str, Any]) -> None:
    for name in ("short0", "short1", "long"):
        case = recorded[name]
        assert gemma_fp32.engine.encode_prompt(case["text"]) == case["ids"], name


def test_greedy_matches_transformers(gemma_fp32: LLM, recorded: dict[str, Any]) -> None:
    """Short prompts, and one past the window prefilled in 128-token chunks."""
    cases = [recorded[name] for name in ("short0", "short1", "long")]
    assert len(cases[-1]["ids"]) > 512 + 128
    sp = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, min_tokens=GREEDY_TOKENS)
    outs = gemma_fp32.generate([c["ids"] for c in cases], sp, use_tqdm=False)
    for case, out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == case["greedy"]


def test_prefix_cache_hit_past_the_window(gemma_fp32: LLM, recorded: dict[str, Any]) -> None:
    shared, case = recorded["long"]["ids"], recorded["prefix_hit"]
    sp = SamplingParams(temperature=0, max_tokens=HIT_TOKENS, min_tokens=HIT_TOKENS)
    gemma_fp32.generate([shared], sp, use_tqdm=False)
    before = gemma_fp32.engine.kv.num_hit_tokens
    out = gemma_fp32.generate([case["ids"]], sp, use_tqdm=False)[0]
    assert gemma_fp32.engine.kv.num_hit_tokens - before > 512
    assert out.outputs[0].token_ids == case["greedy"]


def test_quantized_weights_load_and_agree(recorded: dict[str, Any]) -> None:
    """The default load keeps the GGUF's blocks (Q4_K, Q5_0, Q6_K, Q8_0) quantized."""
    llm = LLM(model=MODEL, kv_cache_memory=0.25)
    assert llm.engine.quantization == "gguf"
    assert llm.engine.runner.weight_bytes() < 0.5 * 268_098_176 * 4  # far below fp32
    sp = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    case = recorded["short0"]
    first = llm.generate([case["ids"]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert first[:2] == case["greedy"][:2]


@pytest.mark.slow
def test_recording_is_what_transformers_gives(
    hf_gemma: tuple[Any, Any], gemma_path: Path, recorded: dict[str, Any]
) -> None:
    assert record(hf_gemma, gemma_path)["cases"] == recorded


@pytest.mark.slow
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
    sp = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, min_tokens=GREEDY_TOKENS)
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


if __name__ == "__main__":  # python -m tests.test_gemma3: record transformers' answers
    from sluice.loader.resolve import resolve_model_path

    model_path = resolve_model_path(MODEL)
    data = record(transformers_from_gguf(model_path), model_path)
    REFERENCE.write_text(json.dumps(data) + "\n")
    print(f"wrote {REFERENCE}", file=sys.stderr)
