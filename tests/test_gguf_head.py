"""The GGUF output head's two-level int8 activations (csrc/qblock.cpp, matmul_head: two
levels for the tokens near the top, one for the rest) pick the same greedy tokens as
unquantized activations (the exact float kernel) on the real models: one level flipped
near-tied logits, two must not (issue 13).

Prompts run one at a time with prefix caching off, so both passes compute every token
the same way and only the head differs."""

from __future__ import annotations

import pytest

from sluice import LLM, SamplingParams
from sluice.kernels import qblock
from sluice.loader.resolve import ModelNotFoundError, resolve_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a python function that reverses a string.",
    "Explain gravity to a child.",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish.",
    "Tell me a joke about cats.",
    "What is 17 * 23?",
]


def greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = []
    for prompt in PROMPTS:
        out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
        outputs.append(list(out[0].outputs[0].token_ids))
    return outputs


def assert_same_greedy(alias: str, max_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=alias, enable_prefix_caching=False)
    head = llm.engine.runner.model.lm_head
    assert head.method.name == "gguf" and head.method.lib is not None
    two_level = greedy(llm, max_tokens)
    with monkeypatch.context() as patch:  # block_quant looks the kernel up at call time
        patch.setattr(
            qblock, "qblock_matmul_head", lambda *args: qblock.qblock_matmul_float(*args[:-1])
        )
        exact = greedy(llm, max_tokens)
    assert two_level == exact


def test_smollm2_head_picks_the_float_heads_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_same_greedy("smollm2-135m", 48, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_heads_pick_the_float_heads_tokens(
    alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        resolve_model_path(alias)
    except ModelNotFoundError as exc:
        pytest.skip(f"{alias} is not installed: {exc}")
    assert_same_greedy(alias, 96, monkeypatch)
