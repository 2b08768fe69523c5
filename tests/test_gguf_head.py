"""The GGUF output head's two-level int8 activations (csrc/qblock.cpp, matmul_head: two
levels for the tokens near the top, one for the rest) on the real models' hidden
states (issue 13): every logit within one of the top is within 2e-4 of the exact
(fp64) one, relative to the top (measured: at most 4.3e-5 on the three packaged
models; one level: 4e-3 to 1.2e-2, which flipped near-tied picks), and the pick is the
two-level kernel's (qblock_matmul_residual).

Exact equality with the exact argmax is not the claim: the generic level's fp32
trajectory meets a top two 1.2e-4 apart at logit 14.2, closer than 15 bits of the
activations resolve. The kernel runs in fp32 here whatever the engine's dtype, so
that bf16's rounding of the logits does not hide the activations' error."""

from __future__ import annotations

import pytest
import torch

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


def head_inputs(llm: LLM, max_tokens: int) -> torch.Tensor:
    """The head's input at every position greedy chat answers to PROMPTS computed."""
    head = llm.engine.runner.model.lm_head
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach().clone()))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    try:
        for prompt in PROMPTS:
            llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
    finally:
        hook.remove()
    return torch.cat(seen)


def assert_head_is_two_level_near_the_top(alias: str, max_tokens: int) -> None:
    llm = LLM(model=alias, enable_prefix_caching=False)
    method = llm.engine.runner.model.lm_head.method
    assert method.name == "gguf" and method.lib is not None and method.row_norm is not None
    w = method.weight
    args = (w.packed, w.hbits, w.scale, w.minimum, w.super_scale, w.bits, w.group)
    x = head_inputs(llm, max_tokens).float()  # (bf16 inputs convert exactly)
    assert len(x) >= 4 * len(PROMPTS)  # prompts and answers, not a stub
    got = qblock.qblock_matmul_head(method.lib, x, *args, method.row_norm)
    assert torch.equal(got.argmax(1), qblock.qblock_matmul_residual(method.lib, x, *args).argmax(1))
    exact = x.double() @ qblock.qblock_dequantize(method.lib, *args, torch.float32).double().t()
    top = exact.amax(1, keepdim=True)
    near = exact >= top - 1.0
    err = (got.double() - exact).abs() / top.abs()
    assert err[near].max() < 2e-4


def test_smollm2_head_is_two_level_near_the_top() -> None:
    assert_head_is_two_level_near_the_top("smollm2-135m", 48)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_heads_are_two_level_near_the_top(alias: str) -> None:
    try:
        resolve_model_path(alias)
    except ModelNotFoundError as exc:
        pytest.skip(f"{alias} is not installed: {exc}")
    assert_head_is_two_level_near_the_top(alias, 96)
