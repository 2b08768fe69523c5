"""The one-call decoder stack for small CPU decode steps returns exactly what the
Python model returns: the same tokens and bit-identical logprobs, whether it runs or
not, with int4 and int8 weights, on the real model and on random Llama (head size 32,
generic attention math) and Qwen2 (QKV biases) models, with the formats mixed per
linear as GGUF files mix them (qblock layouts beside int4 and int8), and on random
GGUF files of the QK-norm (Qwen3) and Mixture-of-Experts families (Qwen3-MoE, OLMoE,
Mixtral, Granite-MoE: routing, grouped experts and their weighted sum in the stack) and
of gpt-oss (attention sinks, windowed layers, biases, MXFP4 experts, the clamped
SwiGLU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.random_gguf import hf_to_gguf
from benchmarks.random_models import SMALL, build_model, write_random_adapter
from sluice import LLM, SamplingParams, kernels
from sluice.attention.backend import AttentionMetadata
from sluice.core.quantized_tensor import QuantizedTensor, pack, unpack_values
from sluice.kernels import cpu, qblock
from sluice.layers.block_quant import GEMM_MIN_ROWS, INT8_GEMM_LEVELS, BlockQuantized
from sluice.layers.linear import Linear
from sluice.layers.quantization import Int8WeightOnly
from sluice.loader import tokenizer_from_gguf
from sluice.models import llama_decode_stack
from sluice.models.llama_decode_stack import LlamaDecodeStack
from tests.conftest import kernels_at, level_cases
from tests.test_architectures import build
from tests.test_moe_gguf import VOCAB, tokenizer

__all__ = ["tokenizer"]  # a fixture, used by name


@pytest.fixture
def active_kernels() -> Iterator[str]:
    """The kernels this machine uses by default (skipped only without a compiler)."""
    with kernels_at(cpu.level()) as level:
        yield level


PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, a dragon"]
# Up to twelve at once: steps of 4-12 rows, which the stack takes on GGUF weights.
MANY_PROMPTS = [
    *PROMPTS,
    "The river rose",
    "import numpy as np",
    "My favourite colour is",
    "Water boils at",
    "Dear Sir or Madam,",
    "The best way to learn a language",
    "SELECT name FROM",
    "In 1969, the first",
    "Roses are red,",
]


def stack_rows(quantization: str) -> int:
    """The most rows a step the stack takes: on GGUF weights what one pass of the qblock
    kernel serves (12 at AVX-512, 4 at AVX2; 3 at the generic level, whose dense GEMM
    takes over at 4), else 3."""
    if quantization != "gguf":
        return 3
    level = kernels.built_level(kernels.load())
    return {"avx512": 12, "avx2": 4, "generic": 3}[level]


def built_stack(llm: LLM) -> Any:
    """The engine's stack, which must exist: the tests using this run under a kernel
    level (the `kernel_level` fixture skips only where the CPU or a compiler lacks it),
    and every level has the stack, so a regression that stops it being built fails."""
    stack = llm.engine.runner.decode_stack
    assert stack is not None, "the decode stack was not built"
    return stack


def run(
    llm: LLM, prompts: list[Any], use_stack: bool, lora_request: Any = None
) -> tuple[list[Any], int]:
    """Outputs with or without the stack, and how many steps the stack ran."""
    runner = llm.engine.runner
    stack = runner.decode_stack
    calls = 0

    class Counting:
        has_lora = stack.has_lora

        def accepts(self, num_tokens: int, meta: AttentionMetadata) -> bool:
            return stack.accepts(num_tokens, meta)

        def __call__(self, *args: Any) -> torch.Tensor:
            nonlocal calls
            calls += 1
            return stack(*args)

    runner.decode_stack = Counting() if use_stack else None
    # Both runs compute every token: a prefix-cache hit would turn the second run's
    # 17-token prefill (dense weights) into a 1-token step (int4 weights).
    llm.engine.reset_prefix_cache()
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=3)
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora_request)
    finally:
        runner.decode_stack = stack
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls


def assert_stack_equals_model(llm: LLM, prompts: list[Any], max_rows: int = 3) -> None:
    """max_rows: what the stack must take (stack_rows)."""
    stack = built_stack(llm)
    assert stack.max_rows == max_rows
    eager, none = run(llm, prompts, use_stack=False)
    fused, calls = run(llm, prompts, use_stack=True)
    assert none == 0 and calls > 0
    assert fused == eager  # token ids and logprob floats, exactly


# Every weight format and dtype at the best level this CPU runs; the AVX2 machines'
# default (int4 weights, fp32 activations) at each lower level too.
CONFIGS = [
    ("int4", "bfloat16"),
    ("int4", "float32"),
    ("int8", "bfloat16"),
    ("gguf", "bfloat16"),
    ("gguf", "float32"),
]
CASES = level_cases(CONFIGS, [("int4", "float32"), ("gguf", "float32")], dtype_at=1)


@pytest.mark.parametrize(("level", "quantization", "dtype"), CASES)
def test_stack_equals_model_on_smollm2(level: str, quantization: str, dtype: str) -> None:
    # Three prompts decode as 3-row steps, then one alone; chunks of 3 prompt tokens
    # (max_num_batched_tokens=3) are multi-query rows of one sequence.
    with kernels_at(level):
        assert_stack_equals_model_on_smollm2(quantization, dtype)


def assert_stack_equals_model_on_smollm2(quantization: str, dtype: str) -> None:
    llm = LLM(quantization=quantization, dtype=dtype, kv_cache_memory=0.05)
    # FORMAT_INT4, FORMAT_INT8; the GGUF's Q4_1 linears are qblock 4 bits / 32 (432).
    formats = {432} if quantization == "gguf" else {int(quantization[-1])}
    assert built_stack(llm).formats == formats
    rows = stack_rows(quantization)
    assert_stack_equals_model(llm, MANY_PROMPTS[: max(rows, 3)], rows)  # steps of `rows` rows
    llm = LLM(
        quantization=quantization, dtype=dtype, kv_cache_memory=0.05, max_num_batched_tokens=3
    )
    assert_stack_equals_model(llm, PROMPTS[:1], rows)


@pytest.mark.parametrize(
    ("level", "dtype"), level_cases([("bfloat16",)], [("float32",)], dtype_at=0)
)
def test_stack_equals_model_with_an_int8_kv_cache(level: str, dtype: str) -> None:
    # The stack writes and reads int8 K/V rows with the same kernels as the layers.
    with kernels_at(level):
        llm = LLM(quantization="gguf", dtype=dtype, kv_cache_memory=0.05, kv_cache_dtype="int8")
        assert built_stack(llm).shape.kv_int8
        assert_stack_equals_model(llm, PROMPTS, stack_rows("gguf"))


@pytest.mark.parametrize(
    ("kind", "quantization"), [("llama", "int4"), ("qwen2", "int4"), ("qwen2", "int8")]
)
def test_stack_equals_model_on_random_models(
    kind: str, quantization: str, tmp_path: Path, smollm2_path: Path, kernel_level: str
) -> None:
    build(kind, tmp_path, smollm2_path)
    llm = LLM(model=str(tmp_path), quantization=quantization, dtype="float32", kv_cache_memory=0.02)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 9, 17)]
    assert_stack_equals_model(llm, prompts)


def test_stack_takes_only_small_all_decode_steps(active_kernels: str) -> None:
    llm = LLM(quantization="int4", kv_cache_memory=0.05)
    stack = built_stack(llm)
    small = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.long), num_small_tokens=3)
    assert stack.accepts(3, small)
    assert not stack.accepts(4, AttentionMetadata(torch.zeros(4), num_small_tokens=4))
    assert not stack.accepts(3, AttentionMetadata(torch.zeros(3), num_small_tokens=1))


def test_stack_is_built_only_where_every_kernel_is_ours(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, active_kernels: str
) -> None:
    assert LLM(quantization="int4", kv_cache_memory=0.05).engine.runner.decode_stack is not None
    assert LLM(quantization="none", kv_cache_memory=0.05).engine.runner.decode_stack is None
    build("qwen3", tmp_path, smollm2_path)  # QK-norm: in the stack
    llm = LLM(model=str(tmp_path), quantization="int4", kv_cache_memory=0.02)
    assert llm.engine.runner.decode_stack is not None
    monkeypatch.setattr(llama_decode_stack.kernels, "load", lambda: None)
    assert LLM(quantization="int4", kv_cache_memory=0.05).engine.runner.decode_stack is None


def with_integer_scales(qt: QuantizedTensor) -> QuantizedTensor:
    """qt's values with its scales (and offsets) as the K-quants store theirs: int8
    times a float16 multiplier per 256 values (rounded there: a weight near qt)."""
    n, groups = qt.scale.shape
    per = groups // (qt.shape[1] // 256)

    def split(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = v.float().view(n, -1, per)
        mult = (v.abs().amax(-1) / 127).clamp(min=1e-8).half()
        q = (v / mult.float()[..., None]).round().clamp(-127, 127)
        return q.view(n, groups), mult[:, None]

    u, (d, sd) = unpack_values(qt), split(qt.scale)
    if qt.symmetric:
        return pack(u, d, None, qt.bits, qt.group, qt.source, sd)
    m, sm = split(qt.minimum)
    return pack(u, d, m, qt.bits, qt.group, qt.source, torch.cat([sd, sm], 1))


def block_quantized(
    layer: Linear,
    w: torch.Tensor,
    bits: int,
    group: int,
    symmetric: bool = False,
    integer: bool = False,
) -> BlockQuantized:
    """The layer on the GGUF path's method, with `w` quantized to a qblock layout: our
    kernel below `dense_min_rows` rows, dequantized tiles from there. Symmetric as
    Q6_K is: no stored offsets, m = -2**(bits - 1) * d; integer: the K-quants' scales."""
    n, k = w.shape
    groups = w.float().view(n, k // group, group)
    lo = groups.amin(-1)
    if symmetric:
        d = (groups.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp(min=1e-6).half()
        m = -(2 ** (bits - 1)) * d.float()
    else:
        d = ((groups.amax(-1) - lo) / (2**bits - 1)).clamp(min=1e-6).half()
        m = lo.half().float()
    u = ((groups - m[..., None]) / d.float()[..., None]).round().clamp(0, 2**bits - 1)
    method = BlockQuantized()
    stored = None if symmetric else m
    qt = pack(u.view(n, k).to(torch.uint8), d, stored, bits, group)
    method.load_quantized(layer, with_integer_scales(qt) if integer else qt)
    method.dense_min_rows = 4
    return method


def int4_weight(layer: Linear) -> torch.Tensor:
    """The int4 layer's weight as its kernel sees it: q * scale + min per 32."""
    lo, hi = layer.q4_packed & 15, layer.q4_packed >> 4
    n = lo.shape[0]
    q = torch.cat([lo.view(n, -1, 16), hi.view(n, -1, 16)], dim=-1).float()
    return (q * layer.q4_scale[..., None].float() + layer.q4_min[..., None].float()).view(n, -1)


def test_stack_equals_model_with_mixed_weight_formats(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_level: str
) -> None:
    # As a GGUF file mixes them: each linear its own format, qblock's beside int4 and
    # int8, one format differing between layers (Q4_K_M's ffn_down), float16 scales
    # beside integer ones (the K-quants': down's K = 256 is one super-block).
    build("qwen2", tmp_path, smollm2_path)
    llm = LLM(model=str(tmp_path), quantization="int4", dtype="float32", kv_cache_memory=0.02)
    runner = llm.engine.runner
    first, second, third = runner.model.layers[:3]
    formats: list[tuple[Linear, int, int, bool, bool]] = [
        (first.self_attn.o_proj, 5, 32, False, False),
        (first.mlp.gate_up_proj, 8, 16, False, False),
        (first.mlp.down_proj, 6, 16, True, True),  # Q6_K's layout and scales
        (second.self_attn.qkv_proj, 5, 16, False, False),
        (second.mlp.down_proj, 8, 32, False, False),
        (second.mlp.gate_up_proj, 4, 16, False, False),
        (third.mlp.down_proj, 4, 32, False, True),  # Q4_K's
    ]
    for layer, bits, group, symmetric, integer in formats:
        method = block_quantized(layer, int4_weight(layer), bits, group, symmetric, integer)
        layer.method = method
    o = second.self_attn.o_proj
    o.weight = torch.nn.Parameter(int4_weight(o), requires_grad=False)
    o.method = Int8WeightOnly()
    o.method.process_weight(o)
    runner.decode_stack = LlamaDecodeStack.build(runner.model, runner.backend, runner.kv_caches)
    assert built_stack(llm).formats == {4, 8, 532, 816, 616, 516, 832, 416, 432}
    assert third.mlp.down_proj.qb_super.numel()  # integer scales reach the stack
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 9, 17)]
    assert_stack_equals_model(llm, prompts)


# A 512-token vocabulary keeps writing and loading the GGUF files fast.
GGUF_SHAPE = {**SMALL, "vocab_size": VOCAB}


def random_gguf(kind: str, tensor_type: str, directory: Path, vocab: Path) -> Path:
    """A random-weight model of `kind` (benchmarks/random_models.py) as a GGUF file."""
    build_model(kind, GGUF_SHAPE, directory / "hf")
    path = directory / f"{kind}-{tensor_type}.gguf"
    hf_to_gguf(directory / "hf", path, tensor_type=tensor_type, tokenizer_gguf=vocab)
    return path


def random_prompts(seed: int, count: int = 3) -> list[list[int]]:
    """`count` prompts of 5, 9, 17, 5, ... tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [(5, 9, 17)[i % 3] for i in range(count)]
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize(
    ("kind", "tensor_type", "dtype"),
    [
        ("qwen3", "Q8_0", "float32"),  # QK-norm per head
        ("qwen3", "Q4_0", "bfloat16"),
        ("qwen3moe", "Q8_0", "float32"),  # QK-norm per head, top 3 renormalized
        ("qwen3moe", "Q8_0", "bfloat16"),
        ("olmoe", "Q8_0", "float32"),  # QK-norm over the whole projections, top 2 as is
        ("olmoe", "Q4_0", "bfloat16"),
        ("mixtral", "Q8_0", "bfloat16"),  # no QK-norm, top 2 renormalized
        ("granite", "Q8_0", "float32"),  # its scalings of embeddings, sublayers, scores
        ("granite", "Q4_0", "bfloat16"),
        ("granitemoe", "Q8_0", "bfloat16"),  # a softmax over the top k logits
        # Sinks, a 16-token window on even layers, q/k/v/o, router and expert biases, a
        # softmax over the top k, the clamped SwiGLU, MXFP4 experts beside Q8_0.
        ("gpt_oss", "MXFP4_Q8_0", "float32"),
        ("gpt_oss", "MXFP4_Q8_0", "bfloat16"),
    ],
)
def test_stack_equals_model_on_random_gguf_models(
    kind: str,
    tensor_type: str,
    dtype: str,
    tmp_path: Path,
    tokenizer: Path,
    kernel_level: str,
) -> None:
    path = random_gguf(kind, tensor_type, tmp_path, tokenizer)
    llm = LLM(model=str(path), quantization="gguf", dtype=dtype, kv_cache_memory=0.02)
    stack = built_stack(llm)
    config = llm.engine.model_config
    assert stack.shape.experts == config.num_experts
    no_norm = kind in ("mixtral", "granite", "granitemoe", "gpt_oss")
    assert stack.shape.qk_norm == (0 if no_norm else 1 if "qwen" in kind else 2)
    assert stack.shape.residual_scale == config.residual_multiplier
    assert stack.max_rows == stack_rows("gguf")
    if kind == "gpt_oss":  # its own parts are in the table, not left out
        rows = [dict(zip(stack.table.names, row, strict=True)) for row in stack.table.tensors]
        assert [row["window"] for row in rows[:2]] == [16, 0]
        parts = ("sinks", "o_bias", "router_bias", "gate_up_bias", "down_bias")
        assert all(row[name] is not None for row in rows for name in parts)
        assert stack.shape.softmax_after_top_k and stack.shape.swiglu_limit > 0
    experts = [layer.mlp.experts for layer in llm.engine.runner.model.layers if config.is_moe]
    # Decode steps of as many rows as the stack takes (an expert may get every row), and
    # a 5-token prompt alone: its prefill is a 5-row step of the stack.
    prompts = random_prompts(3, stack_rows("gguf"))
    for batch in (prompts, prompts[:1]):
        counts = []
        outputs = []
        for use_stack in (False, True):
            start = [e.tokens.clone() for e in experts]
            out, calls = run(llm, batch, use_stack)
            assert (calls > 0) == use_stack
            outputs.append(out)
            counts.append([e.tokens - s for e, s in zip(experts, start, strict=True)])
        assert outputs[1] == outputs[0]  # token ids and logprob floats, exactly
        for eager, fused in zip(*counts, strict=True):  # the stack counts experts' rows
            assert torch.equal(fused, eager) and int(eager.sum()) > 0


def test_stack_equals_model_on_gpt_oss_with_an_int8_kv_cache(
    tmp_path: Path, tokenizer: Path, active_kernels: str
) -> None:
    # The sinks and windows read int8 K/V rows through the same kernel in both paths.
    path = random_gguf("gpt_oss", "MXFP4_Q8_0", tmp_path, tokenizer)
    llm = LLM(model=str(path), quantization="gguf", dtype="bfloat16", kv_cache_memory=0.02,
              kv_cache_dtype="int8")  # fmt: skip
    assert built_stack(llm).shape.kv_int8
    assert_stack_equals_model(llm, random_prompts(6, stack_rows("gguf")), stack_rows("gguf"))


def test_stack_equals_model_where_every_layer_has_a_window(
    tmp_path: Path, smollm2_path: Path, active_kernels: str
) -> None:
    # Mistral 7B v0.1's attention (a checkpoint's sliding_window: every layer windowed,
    # 8 tokens here), so the KV manager frees each request's blocks behind the window
    # while the stack decodes (prompts of up to 17 tokens, 12 more generated).
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(**SMALL, sliding_window=8, rope_theta=1e4)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    tokenizer_from_gguf(smollm2_path).save(tmp_path)
    llm = LLM(model=str(tmp_path), quantization="int4", dtype="float32", kv_cache_memory=0.02)
    assert llm.engine.model_config.kv_window() == 8
    stack = built_stack(llm)
    assert all(dict(zip(stack.table.names, row, strict=True))["window"] == 8
               for row in stack.table.tensors)  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 9, 17)]
    assert_stack_equals_model(llm, prompts)


@pytest.mark.parametrize(("kind", "tensor_type"), [("qwen3", "Q4_0"), ("olmoe", "Q8_0")])
def test_stack_runs_the_int8_gemm_where_eager_does(
    kind: str, tensor_type: str, tmp_path: Path, tokenizer: Path, kernel_level: str
) -> None:
    # With int8 prompts at a level that has the int8 GEMM, eager layers take it from
    # GEMM_MIN_ROWS rows (experts by their own rows), and so does the stack, which then
    # takes decode steps of up to 32 streams. The router of each MoE layer sends every
    # row to experts 0 or 1 (random logits) or else to 2 and 3 (the rest score 0, and
    # the first of tied experts wins): steps mix experts of many rows, on the GEMM,
    # with experts of few, on the grouped kernel.
    assert_stack_runs_the_gemm_as_eager(random_gguf(kind, tensor_type, tmp_path, tokenizer))


@pytest.mark.parametrize(("kind", "tensor_type"), [("qwen3", "Q4_0"), ("olmoe", "Q8_0")])
def test_stack_runs_the_gemm_on_amx_int8_tiles_where_eager_does(
    kind: str, tensor_type: str, tmp_path: Path, tokenizer: Path
) -> None:
    # At the amx level both take the GEMM's tile path (the same sums as VNNI's); the
    # tile calls counted show it ran.
    with kernels_at("amx"):
        lib = kernels.load()
        assert lib is not None
        path = random_gguf(kind, tensor_type, tmp_path, tokenizer)
        before = qblock.amx_int8_calls(lib)
        stack = assert_stack_runs_the_gemm_as_eager(path)
        assert stack.shape.gemm_tiles and qblock.amx_int8_calls(lib) > before


def assert_stack_runs_the_gemm_as_eager(path: Path) -> LlamaDecodeStack:
    """The stack built for the GGUF at `path` with int8 prompts takes the int8 GEMM where
    the level has it, as eager does, with the same token ids and logprobs."""
    llm = LLM(model=str(path), quantization="gguf", dtype="bfloat16", kv_cache_memory=0.02,
              prompt_activations="int8")  # fmt: skip
    stack = built_stack(llm)
    gemm = kernels.variant() in INT8_GEMM_LEVELS
    assert stack.shape.gemm_min_rows == (GEMM_MIN_ROWS[kernels.variant()] if gemm else 0)
    assert stack.max_rows == (32 if gemm else stack_rows("gguf"))
    assert stack.shape.gemm_tiles == kernels.tiles(stack.lib)
    model = llm.engine.runner.model
    for layer in model.layers:
        if llm.engine.model_config.is_moe:
            layer.mlp.router.data[2:] = 0
    prompts = random_prompts(4, stack.max_rows)
    eager, none = run(llm, prompts, use_stack=False)
    fused, calls = run(llm, prompts, use_stack=True)
    assert none == 0 and calls > 0
    assert fused == eager  # token ids and logprob floats, exactly
    return stack


def test_stack_is_not_built_for_a_shared_expert_or_dense_experts(
    tmp_path: Path, tokenizer: Path, active_kernels: str
) -> None:
    path = random_gguf("qwen2moe", "Q8_0", tmp_path, tokenizer)  # its shared expert
    llm = LLM(model=str(path), quantization="gguf", dtype="float32", kv_cache_memory=0.02)
    assert llm.engine.runner.decode_stack is None
    path = random_gguf("olmoe", "Q8_0", tmp_path, tokenizer)
    llm = LLM(model=str(path), quantization="gguf", dtype="float32", kv_cache_memory=0.02)
    runner = llm.engine.runner
    assert LlamaDecodeStack.build(runner.model, runner.backend, runner.kv_caches) is not None
    experts = runner.model.layers[1].mlp.experts  # dense in one layer
    experts.gate_up_weight = torch.zeros(experts.num_experts, 2 * experts.inter, experts.hidden)
    assert LlamaDecodeStack.build(runner.model, runner.backend, runner.kv_caches) is None


@pytest.mark.parametrize(
    ("level", "dtype", "lora_dtype"),
    level_cases(
        [("bfloat16", "int8"), ("bfloat16", "model"), ("float32", "int8")],
        [("float32", "int8"), ("float32", "model")],
        dtype_at=0,
    ),
)
def test_stack_equals_model_with_lora_adapters(level: str, dtype: str, lora_dtype: str) -> None:
    """Steps mixing two adapters and the base run in the stack, each adapted linear
    adding its rows' products where the eager Linear adds them (slots in int8 or in
    the model's dtype): the same tokens and logprobs bit for bit as the model layer by
    layer."""
    from sluice import LoRARequest

    lora_dir = Path(__file__).parent / "data" / "lora"
    loras = [
        LoRARequest("sql", 1, str(lora_dir / "smollm2-sql")),
        None,
        LoRARequest("caps", 2, str(lora_dir / "smollm2-caps")),
    ]
    with kernels_at(level):
        llm = LLM(quantization="gguf", dtype=dtype, kv_cache_memory=0.05, enable_lora=True,
                  max_loras=2, lora_dtype=lora_dtype)  # fmt: skip
        stack = built_stack(llm)
        assert stack.has_lora
        assert llm.engine.runner.lora.layers[0].int8 == (lora_dtype == "int8")
        runner = llm.engine.runner
        sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=3)
        adapted_calls = 0

        class Counting:
            has_lora = True

            def accepts(self, num_tokens: int, meta: AttentionMetadata) -> bool:
                return bool(stack.accepts(num_tokens, meta))

            def __call__(self, *args: Any) -> torch.Tensor:
                nonlocal adapted_calls
                adapted_calls += args[-1] is not None
                return stack(*args)  # type: ignore[no-any-return]

        results = []
        for use_stack in (False, True):
            runner.decode_stack = Counting() if use_stack else None  # type: ignore[assignment]
            llm.engine.reset_prefix_cache()
            outs = llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=loras)
            results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        runner.decode_stack = stack
        assert adapted_calls > 0  # steps with adapter rows ran in the stack
        assert results[1] == results[0]
        # The base row is untouched by its neighbours' adapters: the same batch without
        # adapters (same row counts, so the same kernels) gives it the same tokens.
        llm.engine.reset_prefix_cache()
        plain = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert results[1][1][0] == plain[1].outputs[0].token_ids
        assert results[1][0][0] != plain[0].outputs[0].token_ids  # the adapters do act


@pytest.mark.parametrize("lora_dtype", ["int8", "model"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_adds_the_qkv_bias_before_the_adapter(
    dtype: str, lora_dtype: str, tmp_path: Path, tokenizer: Path, kernel_level: str
) -> None:
    """Qwen2's q/k/v biases: the stack adds each to the base output, rounded, before
    the adapter's product (as the eager Linear does), for rows with and without an
    adapter in one step: bit for bit the model layer by layer."""
    from sluice import LoRARequest

    path = random_gguf("qwen2", "Q8_0", tmp_path, tokenizer)
    llm = LLM(model=str(path), quantization="gguf", dtype=dtype, kv_cache_memory=0.02,
              enable_lora=True, max_loras=2, lora_dtype=lora_dtype)  # fmt: skip
    assert built_stack(llm).has_lora
    config = llm.engine.model_config
    folder = write_random_adapter(config, 8, 0, tmp_path / "adapter", b_scale=0.5)
    adapter = LoRARequest("random", 1, str(folder))
    prompts = random_prompts(4, 3)
    loras = [adapter, None, adapter]
    outputs = [run(llm, prompts, use_stack, loras) for use_stack in (False, True)]
    assert outputs[1][1] > 0 and outputs[1][0] == outputs[0][0]
    plain, _ = run(llm, prompts, True)
    assert plain[1] == outputs[1][0][1]  # the base row, beside adapted ones
    assert plain[0][0] != outputs[1][0][0][0]  # the adapter does act
