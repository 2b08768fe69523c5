"""Weight-only int8/int4 linear methods: both kernel paths agree with the dequantized
reference on small shapes, and the quantized model still answers sensibly."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.config import (
    INT8_PROMPTS_MIN_HIDDEN,
    EngineConfig,
    resolve_prompt_activations,
    resolve_quantization,
)
from sluice.kernels import built_level, cpu
from sluice.layers import quantization
from sluice.layers.block_quant import BlockQuantized
from sluice.layers.linear import Linear
from sluice.layers.quantization import (
    DENSE_MIN_ROWS,
    FP32_DENSE_MIN_ROWS,
    FP32_HEAD_DENSE_MIN_ROWS,
    Int4WeightOnly,
    Int8WeightOnly,
    make_linear_method,
    quantized_kernels_only,
)
from sluice.loader import load_model
from tests.conftest import LEVELS, kernels_at, level_cases

PARAGRAPH = (
    "The river rises in the hills north of the town and runs for about forty miles before "
    "it reaches the sea. In the eighteenth century it powered a dozen mills, and barges "
    "carried grain, timber and coal down to the harbour. When the railway arrived in 1847 "
    "the trade moved to the tracks, and most of the mills closed within a generation. "
    "Today the old towpath is a walking trail. Herons fish in the shallows near the weir, "
    "and in late autumn salmon can be seen leaping the falls on their way upstream to "
    "spawn. The town council has restored two of the mill buildings: one is now a museum "
    "of local history, the other a school where children learn how flour was ground by "
    "water power. Visitors can follow the trail from the museum to the estuary in an "
    "afternoon, stopping at the lock keeper's cottage, which serves tea and cakes in the "
    "summer months."
)


def top1_and_perplexity(
    llm: LLM, kernels_only: bool = True, prompts: list[str] | list[list[int]] | None = None
) -> tuple[list[int], float]:
    """The model's top-1 prediction at every position of `prompts` (default: PARAGRAPH;
    teacher-forced) and its perplexity over all of them; with `kernels_only` through the
    quantized kernels even though this is a prefill (a prefill of 4+ rows would
    otherwise take the dense weight and see no quantization), else as the engine runs a
    prompt."""
    sp = SamplingParams(max_tokens=1, prompt_logprobs=1)
    with quantized_kernels_only(llm.engine.runner.model) if kernels_only else nullcontext():
        outs = llm.generate(prompts or [PARAGRAPH], sp, use_tqdm=False)
    top1, logprobs = [], []
    for out in outs:
        assert out.prompt_logprobs is not None
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            assert entry is not None
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            logprobs.append(entry[token].logprob)
    return top1, math.exp(-sum(logprobs) / len(logprobs))


def agreement(top1: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(top1, reference, strict=True)) / len(reference)


def dequantized(layer: Linear, method: Int8WeightOnly | Int4WeightOnly) -> torch.Tensor:
    """Reconstruct the weight the kernel should be multiplying by."""
    if isinstance(method, Int8WeightOnly) and method.lib is None:
        return layer.qweight.float() * layer.qscale.float()[:, None]
    if isinstance(method, Int8WeightOnly):  # ours: offset bytes in pair order
        n, k = layer.q8_packed.shape
        q = layer.q8_packed.view(n, k // 64, 2, 2, 16).transpose(2, 3).reshape(n, k)
        return (q.float() - 128) * layer.q8_scale[:, None]
    n, k = layer.out_features, layer.in_features
    eye = torch.eye(k, dtype=layer.weight.dtype if layer.weight.numel() else torch.bfloat16)
    # Multiplying the identity through the int4 kernel reads the dequantized weight back.
    return method._matmul(layer, eye).float().t().reshape(n, k)


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as our int4 and int8 kernels see it: int8 in blocks of 32, scale absmax / 127."""
    blocks = x.view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks)).round()
    return (q * scale).view_as(x)


def without_our_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantization.kernels, "load", lambda: None)


@pytest.fixture(params=[*LEVELS, "torch"])
def int4_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a weight-only test on each kernel: ours at every instruction-set level this
    CPU has, and torch's."""
    if request.param == "torch":
        without_our_kernels(monkeypatch)
        yield "torch"
        return
    with kernels_at(request.param) as level:
        yield level


def assert_kernel_ran(method: Int8WeightOnly | Int4WeightOnly, kernel: str) -> None:
    """The layer took the kernel the test asked for (a broken selection would otherwise
    test torch's kernel and pass)."""
    if kernel == "torch":
        assert method.lib is None
    else:
        assert method.lib is not None and built_level(method.lib) == kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method_cls", [Int8WeightOnly, Int4WeightOnly])
@pytest.mark.parametrize("rows", [1, 3, 5, 64])  # 64 takes the dense path
def test_weight_only_matches_reference(
    dtype: torch.dtype, method_cls: type, rows: int, int4_kernel: str
) -> None:
    torch.manual_seed(0)
    layer = Linear(128, 96, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    method = method_cls()
    layer.method = method
    w = layer.weight.detach().float().clone()  # CPU bf16 layers drop it for a packed copy
    method.process_weight(layer)
    assert_kernel_ran(method, int4_kernel)
    w_q = dequantized(layer, method)
    # Quantization error is bounded by half a step of the grid.
    step = (w - w_q).abs().max().item()
    assert step < (0.02 if method_cls is Int8WeightOnly else 0.25)
    x = torch.randn(rows, 128, dtype=dtype)
    y = layer(x).float()
    w_used = w if rows >= method.dense_min_rows else w_q
    x_used = x.float()
    if rows < method.dense_min_rows and getattr(method, "lib", None) is not None:
        x_used = int8_blocks(x_used)  # our kernels multiply int8 activations
    ref = x_used @ w_used.t() + layer.bias.float()
    tol = 1e-3 if dtype == torch.float32 else 0.15
    assert torch.allclose(y, ref, atol=tol * ref.abs().max().item(), rtol=0)


def test_int4_reproduces_q4_1_grid_exactly(int4_kernel: str) -> None:
    # A Q4_1 block is d * q + m with q in 0..15; when a group spans the whole range,
    # our asymmetric int4 grid is the same grid, so requantizing loses nothing.
    torch.manual_seed(1)
    q = torch.randint(0, 16, (16, 64))
    q[:, ::32] = 0
    q[:, 1::32] = 15
    # GGUF stores d and m as fp16, so the grid's parameters are fp16 numbers.
    d, m = (torch.rand(16, 2, 1) + 0.1).half().float(), torch.randn(16, 2, 1).half().float()
    w = (q.view(16, 2, 32).float() * d + m).view(16, 64)
    layer = Linear(64, 16)
    with torch.no_grad():
        layer.weight.copy_(w)
    method = Int4WeightOnly()
    method.process_weight(layer)
    assert_kernel_ran(method, int4_kernel)
    assert torch.allclose(dequantized(layer, method), w, atol=1e-4)


def test_int4_keeps_unpackable_shapes_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    without_our_kernels(monkeypatch)  # ours packs any row count
    layer = Linear(64, 8)  # 8 output rows: torch's int4 packing needs multiples of 16
    with torch.no_grad():
        layer.weight.normal_()
    layer.method = Int4WeightOnly()
    layer.method.process_weight(layer)
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), x @ layer.weight.t())


def our_kernel_on_model_shape(
    method: Int8WeightOnly | Int4WeightOnly, k: int, dtype: torch.dtype, seed: int
) -> tuple[Linear, torch.Tensor]:
    """A k -> 48 layer with normal weights, converted by `method` on our kernel (of the
    active level); and its original weight."""
    torch.manual_seed(seed)
    layer = Linear(k, 48).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
    layer.method = method
    w_orig = layer.weight.detach().float().clone()
    method.process_weight(layer)
    assert method.lib is not None
    return layer, w_orig


def assert_rows_match_int8_activations(
    method: Int8WeightOnly | Int4WeightOnly, layer: Linear, w: torch.Tensor, dtype: torch.dtype
) -> None:
    for rows in (1, 2, 3):
        x = torch.randn(rows, layer.in_features, dtype=dtype)
        ref = int8_blocks(x.float()) @ w.t()
        got = method._matmul(layer, x).float()
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got, ref, atol=tol * ref.abs().max().item(), rtol=0), rows
    # A row's result does not depend on its batch: 7 rows (the kernels take rows in
    # blocks of 4, 2 and 1) give each row bit for bit what it gets alone.
    x = torch.randn(7, layer.in_features, dtype=dtype)
    got = method._matmul(layer, x)
    for r in range(7):
        assert torch.equal(method._matmul(layer, x[r : r + 1]), got[r : r + 1]), r


@pytest.mark.parametrize("k", [64, 576])  # 576: 18 blocks, a partial tail of block terms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_int4_kernel_on_model_shapes(k: int, dtype: torch.dtype, kernel_level: str) -> None:
    method = Int4WeightOnly()
    layer, w_orig = our_kernel_on_model_shape(method, k, dtype, seed=2)
    # Dequantize from the packed fields: w = d * q + m per block of 32.
    lo, hi = layer.q4_packed & 15, layer.q4_packed >> 4
    q = torch.cat([lo.view(48, -1, 16), hi.view(48, -1, 16)], dim=-1).float()
    w = (q * layer.q4_scale[..., None].float() + layer.q4_min[..., None].float()).view(48, k)
    assert (w - w_orig).abs().max() <= layer.q4_scale.float().max() / 2 + 1e-2
    assert_rows_match_int8_activations(method, layer, w, dtype)


@pytest.mark.parametrize("k", [64, 576])  # 576: 9 block pairs, an odd count
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_int8_kernel_on_model_shapes(k: int, dtype: torch.dtype, kernel_level: str) -> None:
    method = Int8WeightOnly()
    layer, w_orig = our_kernel_on_model_shape(method, k, dtype, seed=3)
    assert method.lib is not None and not hasattr(layer, "qweight")  # one int8 copy
    w = dequantized(layer, method)
    assert (w - w_orig).abs().max() <= layer.q8_scale.max() / 2 + 1e-6
    assert_rows_match_int8_activations(method, layer, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_crossover_follows_dtype_and_kernel(dtype: torch.dtype, kernel_level: str) -> None:
    # bf16 rows go dense from 4 (oneDNN's packed matmul); fp32 rows stay on our SIMD
    # kernels far longer (torch's sgemm was slow at few rows), the head's float kernel
    # less far; the generic kernels hand over at 4 whatever the dtype.
    fp32_simd = dtype == torch.float32 and kernel_level != "generic"
    cases = [
        (Int8WeightOnly(), FP32_DENSE_MIN_ROWS),
        (Int4WeightOnly(), FP32_DENSE_MIN_ROWS),
        (Int8WeightOnly(quantize_activations=False), FP32_HEAD_DENSE_MIN_ROWS),
    ]
    for method, fp32_rows in cases:
        our_kernel_on_model_shape(method, 576, dtype, seed=5)
        assert method.dense_min_rows == (fp32_rows if fp32_simd else DENSE_MIN_ROWS)
    given = Int4WeightOnly(dense_min_rows=7)
    our_kernel_on_model_shape(given, 576, dtype, seed=5)
    assert given.dense_min_rows == 7


def test_default_weights_answer_a_plain_chat_question() -> None:
    # The defaults (auto: the bundled Q4_1/Q8_0 file as stored, bf16) on a newcomer's
    # first question. With int8 activations in the output head the first token flipped.
    llm = LLM(kv_cache_memory=0.05)
    assert llm.engine.quantization == "gguf"  # on every CPU, whatever auto's dtype
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out.outputs[0].text


def test_int4_keeps_the_output_head_in_int8() -> None:
    llm = LLM(quantization="int4", kv_cache_memory=0.05)
    model = llm.engine.runner.model
    assert isinstance(model.lm_head.method, Int8WeightOnly)
    assert not model.lm_head.method.quantize_activations  # unquantized logits input
    assert isinstance(model.layers[0].mlp.down_proj.method, Int4WeightOnly)
    assert make_linear_method("int4", output_head=True).name == "int8"
    assert make_linear_method("none", output_head=True).name == "none"


def test_auto_runs_a_quantized_file_as_stored_on_cpu() -> None:
    host, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", host, torch.bfloat16, True) == "gguf"
    assert resolve_quantization("auto", host, torch.bfloat16, False) == "none"
    # fp32 that auto chose (no native bf16: AVX2) keeps the file's quantization too...
    assert resolve_quantization("auto", host, torch.float32, True, "auto") == "gguf"
    # ...while an fp32 the user asked for is the exact mode.
    assert resolve_quantization("auto", host, torch.float32, True, "float32") == "none"
    assert resolve_quantization("auto", cuda, torch.bfloat16, True) == "none"
    assert resolve_quantization("int8", host, torch.float32, True) == "int8"
    assert load_model(None).quantized  # the bundled GGUF is Q4_1 and Q8_0
    assert LLM(dtype="bfloat16", kv_cache_memory=0.05).engine.quantization == "gguf"
    assert LLM(dtype="float32", kv_cache_memory=0.05).engine.stats()["quantization"] == "none"


def test_unknown_quantization_is_rejected() -> None:
    with pytest.raises(ValueError, match="quantization"):
        make_linear_method("int3")
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="fp4")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_quantized_model_answers(quantization: str, dtype: str) -> None:
    llm = LLM(quantization=quantization, dtype=dtype, kv_cache_memory=0.05)
    (out,) = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert "Paris" in out.outputs[0].text
    # A chat prompt (~30 tokens): under fp32 on the int8-activation kernels, as decoding.
    # "in one word": the bare question's first token is a near-tie even unquantized
    # ("The" against "L", 0.08 apart in logprob on an AMX Xeon), and the runner-up
    # answers in French; asked for one word, the margin is 1.15-1.5 in every mode.
    question = "What is the capital of France? Answer in one word."
    messages = [{"role": "user", "content": question}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out.outputs[0].text


# Top-1 agreement with fp32 and perplexity, two ways. On the wiki text (below) at this
# CPU's level, with pins tight enough that a doubled error fails; on PARAGRAPH (181
# positions; fp32 perplexity 28.86) at every level, each level's path end to end with
# coarser pins. PARAGRAPH measured 2026-11-23 on an AMD EPYC (Zen 4) at each level:
#   level    bf16   int8/bf16  int4/bf16  int8/fp32  int4/fp32   perplexity (all)
#   avx512   96.7%  92.8%      95.0%      92.8%      95.6%       28.53-29.02
#   avx2       -    92.8%      95.6%      92.3%      95.6%       28.54-29.05
#   generic    -    92.8%      94.5%      91.2%      95.6%       28.63-28.99
# The known regression these pins must catch: an int4 output head (87.9-89.5%,
# perplexity 30.7-31.3, +6-8%). (int8 activations in the output head, the other known
# one, do not show here: 91.7-93.4%, 28.66-29.09; on the wiki text, one int8 level in
# the GGUF head's activations cost 0.7 points (95.9%, 22.003): under the wiki pins too,
# as it raises the error by a fifth, not double; the Paris tests guard that near-tie.)
# gguf (the file's Q4_1/Q8_0 blocks as stored, int8 activations), measured the same
# day: avx512 98.3% (bf16) / 97.2% (fp32), avx2 97.8%, generic 98.9% (fp32); perplexity
# 28.68-28.82: the weights are exactly the file's, only the activations are rounded.
# Pinned a few positions below the lowest measured value, and perplexity at +3%.
PINS = {("none", "bfloat16"): 0.93, "int8": 0.89, "int4": 0.92, "gguf": 0.95}
# The wiki text's cases at this CPU's level (WIKI_PINS); the rest on PARAGRAPH. The
# runtime-quantized ones (int8, int4: a safetensors model with --quantization) push
# 4,096 prompt positions through the decode kernels, over half a minute of one CPU
# each, so they run with `make test-slow`; the default run keeps the default paths
# (the GGUF's blocks, bf16) here and int8 and int4 on PARAGRAPH at every level.
WIKI_CASES = [
    ("none", "bfloat16"),
    pytest.param("int8", "bfloat16", marks=pytest.mark.slow),
    pytest.param("int4", "float32", marks=pytest.mark.slow),
    ("gguf", "bfloat16"),
]
AGREEMENT_CASES = level_cases(
    [("int8", "float32"), ("int4", "bfloat16"), ("gguf", "float32")],
    [("int8", "float32"), ("int4", "float32"), ("gguf", "float32")],  # AVX2's auto
    dtype_at=1,
)

# The wiki text (benchmarks/datasets.py's wiki_text, fetched by `make install`): 8
# windows of 512 tokens spread evenly over it, 4,088 predicted positions, fp32
# perplexity 21.92. Measured 2026-11-28 on an AMD EPYC (Zen 4), agreement with fp32's
# top-1 / perplexity, at avx512 and avx2 (generic: int8/fp32 95.5%, 22.03):
#   none/bf16                  97.5% 21.910   97.6% 21.912
#   int8/bf16                  95.0% 22.059   95.3% 22.019
#   int4/fp32                  96.4% 21.989   96.2% 21.982
#   gguf/bf16                  96.6% 21.976   96.5% 22.001
#   gguf, int8 prompts (GEMM)  96.4% 21.991   (avx512 only)
# Each pin allows 1.5x the larger measured error (missed positions; perplexity's rise,
# at least 0.3%), so a doubled error fails. Shown failing with the int8 weights'
# scales at absmax / 63 (7-bit weights, twice the rounding error): int8/bf16 91.3%,
# while every PARAGRAPH int8 case passed.
WIKI_WINDOWS, WIKI_WINDOW_TOKENS = 8, 512
WIKI_PINS = {  # case: (lowest agreement, highest perplexity / fp32's)
    ("none", "bfloat16"): (0.963, 1.003),
    ("int8", "bfloat16"): (0.925, 1.0093),
    ("int4", "float32"): (0.943, 1.0045),
    ("gguf", "bfloat16"): (0.948, 1.0053),
    "gemm": (0.946, 1.0045),
}


@pytest.fixture(scope="module")
def fp32_reference(llm_fp32: LLM) -> tuple[list[int], float]:
    return top1_and_perplexity(llm_fp32)


@pytest.fixture(scope="module")
def wiki_windows(llm_fp32: LLM) -> list[list[int]]:
    """WIKI_WINDOWS windows of WIKI_WINDOW_TOKENS token ids, evenly spaced over the text."""
    from benchmarks.datasets import wiki_text

    ids = llm_fp32.tokenizer.encode(wiki_text(), add_special_tokens=False)
    step = len(ids) // WIKI_WINDOWS
    assert step >= WIKI_WINDOW_TOKENS
    return [ids[i * step : i * step + WIKI_WINDOW_TOKENS] for i in range(WIKI_WINDOWS)]


@pytest.fixture(scope="module")
def wiki_reference(llm_fp32: LLM, wiki_windows: list[list[int]]) -> tuple[list[int], float]:
    return top1_and_perplexity(llm_fp32, prompts=wiki_windows)


def assert_wiki_pins(
    got: tuple[list[int], float], reference: tuple[list[int], float], pins: tuple[float, float]
) -> None:
    (top1, ppl), (ref_top1, ref_ppl) = got, reference
    assert len(ref_top1) == WIKI_WINDOWS * (WIKI_WINDOW_TOKENS - 1)
    assert agreement(top1, ref_top1) >= pins[0], (agreement(top1, ref_top1), pins)
    assert ppl <= pins[1] * ref_ppl, (ppl / ref_ppl, pins)


@pytest.mark.parametrize(("quantization", "dtype"), WIKI_CASES)
def test_agreement_and_perplexity_on_the_wiki_text(
    wiki_windows: list[list[int]],
    wiki_reference: tuple[list[int], float],
    quantization: str,
    dtype: str,
) -> None:
    llm = LLM(dtype=dtype, quantization=quantization, kv_cache_memory=0.05)
    assert llm.engine.quantization == quantization
    got = top1_and_perplexity(llm, prompts=wiki_windows)
    assert_wiki_pins(got, wiki_reference, WIKI_PINS[(quantization, dtype)])


@pytest.mark.parametrize(("level", "quantization", "dtype"), AGREEMENT_CASES)
def test_agreement_and_perplexity_are_pinned(
    fp32_reference: tuple[list[int], float], level: str, quantization: str, dtype: str
) -> None:
    reference, reference_ppl = fp32_reference
    with kernels_at(level):
        llm = LLM(dtype=dtype, quantization=quantization, kv_cache_memory=0.05)
        assert llm.engine.quantization == quantization
        fast, ppl = top1_and_perplexity(llm)
    share = agreement(fast, reference)
    assert share >= PINS.get((quantization, dtype), PINS.get(quantization, 0)), share
    assert ppl <= 1.03 * reference_ppl, (ppl, reference_ppl)


def test_engine_reports_its_kernel_level(llm_fp32: LLM) -> None:
    # The level this CPU (or SLUICE_CPU_ISA) selects is what the engine runs and reports
    # (/stats, /metrics and benchmark results read it from there).
    from sluice import kernels

    assert llm_fp32.engine.stats()["cpu_kernels"] == kernels.level_in_use() == cpu.level()
    assert kernels.variant() == kernels.library_level(cpu.level())  # the library's build


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_head_kernel_keeps_activations_unquantized(
    dtype: torch.dtype, kernel_level: str
) -> None:
    # The head's int8 weights times unquantized activations on our kernel of each level:
    # equal to the dequantized weight times x, without int8 activation blocks.
    method = Int8WeightOnly(quantize_activations=False)
    layer, _ = our_kernel_on_model_shape(method, 576, dtype, seed=4)
    assert method.lib is not None and built_level(method.lib) == kernel_level
    w = dequantized(layer, method)
    for rows in (1, 3, 15):  # 15: blocks of 8, 4, 2 and 1 rows (AVX-512), 4, 2, 1 (AVX2)
        x = torch.randn(rows, 576, dtype=dtype)
        ref = x.float() @ w.t()
        got = method._matmul(layer, x)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=0), rows
        # A row's logits do not depend on its batch: bit for bit the row alone.
        for r in range(rows):
            assert torch.equal(method._matmul(layer, x[r : r + 1]), got[r : r + 1]), (rows, r)


@pytest.mark.skipif("avx512" not in cpu.available_levels(), reason="the int8 GEMM is AVX-512's")
def test_int8_prompts_take_the_gemm_and_keep_the_pinned_agreement(
    wiki_windows: list[list[int]],
    wiki_reference: tuple[list[int], float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # prompt_activations="int8": the prompt's matmuls take the int8 GEMM (the int8
    # activations a decode step's block kernel takes), held to WIKI_PINS["gemm"].
    from sluice.kernels import qblock

    calls = []
    gemm = qblock.qblock_gemm
    monkeypatch.setattr(qblock, "qblock_gemm", lambda *a, **kw: calls.append(1) or gemm(*a, **kw))
    with kernels_at("avx512"):
        llm = LLM(quantization="gguf", prompt_activations="int8", kv_cache_memory=0.05)
        got = top1_and_perplexity(llm, kernels_only=False, prompts=wiki_windows)
    assert calls  # every layer but the head: the prompt's rows are past the crossover
    assert_wiki_pins(got, wiki_reference, WIKI_PINS["gemm"])


def test_prompt_activations_auto_follows_the_model_size() -> None:
    # auto: float below INT8_PROMPTS_MIN_HIDDEN (the bundled model keeps its answer:
    # test_default_weights_answer_a_plain_chat_question), int8 from there.
    assert not resolve_prompt_activations("auto", INT8_PROMPTS_MIN_HIDDEN - 1)
    assert resolve_prompt_activations("auto", INT8_PROMPTS_MIN_HIDDEN)
    assert resolve_prompt_activations("int8", 64) and not resolve_prompt_activations("float", 4096)
    with pytest.raises(ValueError, match="prompt_activations"):
        EngineConfig(prompt_activations="int4")
    llm = LLM(kv_cache_memory=0.05)  # the bundled SmolLM2: hidden size 576
    methods = [m.method for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert methods and not any(isinstance(m, BlockQuantized) and m.int8_gemm for m in methods)
