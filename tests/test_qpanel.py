"""K-quant weights in panel order (sluice/kernels/qpanel.py, csrc/qpanel.h): the panel
kernel gives a row the same result at every row count, for Q4_K's and Q6_K's layouts,
dense and as stacked experts: the int8 GEMM's sums bit for bit where the level has them
(qpanel.gemm_sums), at avx2 exact integer sums a super-block (no int16 sum overflows at
the formats' extreme values); what has no panel layout is refused; and a model that
takes int8 prompts keeps its linears and expert stacks in panels at the levels that use
them, the decode stack agreeing with eager."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from benchmarks import random_gguf
from benchmarks.random_gguf import SHAPES, write_shaped
from sluice import LLM, kernels
from sluice.core.quantized_tensor import QuantizedTensor, dequantize
from sluice.kernels import qblock, qpanel
from sluice.layers.block_quant import HEAD_PANEL_LEVELS, PANEL_LEVELS
from sluice.layers.experts import ExpertGroups
from tests.test_decode_stack import assert_stack_runs_the_gemm_as_eager
from tests.test_moe_gguf import VOCAB, tokenizer
from tests.test_qblock_kernels import (
    assert_two_level_where_it_may_be_picked,
    head_row_norms,
    pack,
    random_weight,
)

__all__ = ["tokenizer"]  # a fixture, used by name


@pytest.fixture
def lib(kernel_level: str) -> kernels.Library:
    loaded = kernels.load()
    assert loaded is not None and kernels.built_level(loaded) == kernel_level
    return loaded


def k_quant(n: int, k: int, bits: int, symmetric: bool, seed: int = 0) -> QuantizedTensor:
    """A random weight in Q4_K's layout (4 bits, groups of 32, offsets) or Q6_K's (6
    bits, groups of 16), either with or without stored offsets; integer scales."""
    group = 32 if bits == 4 else 16
    w = random_weight(n, k, bits, group, seed, symmetric=symmetric, integer=True)
    return QuantizedTensor(bits, group, w.packed, w.hbits, w.d, w.m, w.s)


FORMATS = [(4, False), (4, True), (6, True), (6, False)]


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panels_compute_the_int8_gemms_sums_at_every_row_count(
    lib: kernels.Library, bits: int, symmetric: bool, dtype: torch.dtype
) -> None:
    # 96 rows: three panels (two threads, one with two); K of 768: three super-blocks.
    w = k_quant(96, 768, bits, symmetric)
    panels = qpanel.to_panels(lib, w)
    assert panels.panels and not w.panels and panels.shape == w.shape
    assert [t.shape for t in panels.parts()] == [t.shape for t in w.parts()]
    gen = torch.Generator().manual_seed(1)
    # Up to 8 rows a pass (12: two of 6, 17: three; avx2: 4); from 40 on, each panel
    # unpacked once (AVX-512). Where the sums are the kernel's own (avx2), a row's are
    # the same in every batch and within float rounding of the GEMM's.
    full = torch.randn(45, 768, generator=gen).to(dtype)
    batch = qpanel.qpanel_matmul(lib, full, panels)
    for m in (1, 2, 3, 4, 5, 8, 9, 12, 17, 39, 40, 45):
        x = full[:m]
        got = qpanel.qpanel_matmul(lib, x, panels)
        want = qblock.qblock_gemm(lib, x, *w.parts(), w.bits, w.group)
        assert torch.equal(got, batch[:m]), m
        if qpanel.gemm_sums(lib):
            assert torch.equal(got, want), m
        else:
            tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: an ulp of the output
            assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max(), m
    # ... and that is x @ W.T within the int8 activations' error.
    x = torch.randn(4, 768, generator=gen)
    exact = x @ dequantize(w).T
    got = qpanel.qpanel_matmul(lib, x, panels)
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
def test_panel_sums_are_exact_at_the_formats_extreme_values(
    lib: kernels.Library, bits: int, symmetric: bool
) -> None:
    # Every value at the format's top (or 0), every scale and offset at int8's ends,
    # activations all at +-127: the largest partial sums a kernel can meet (avx2 sums a
    # group's products in int16, 6 bits with offsets two steps at a time; an overflow
    # there is off by 2^16 somewhere in a super-block). x @ W.T to float rounding.
    group = 32 if bits == 4 else 16
    n, k = 64, 512
    top = (1 << bits) - 1
    for value, scale, sign in (top, 127, 1.0), (0, -128, -1.0), (top, -128, -1.0):
        u = torch.full((n, k), value)
        d = torch.full((n, k // group), scale, dtype=torch.int8)
        m = torch.full((n, k // group), 127 if symmetric else scale, dtype=torch.int8)
        sup = torch.full((n, 1 if symmetric else 2, k // 256), 1e-3).half()
        packed = pack(u, d, m[:0] if symmetric else m, bits, group, sup)
        w = QuantizedTensor(bits, group, packed.packed, packed.hbits, packed.d, packed.m, packed.s)
        x = torch.full((3, k), sign)
        x[1, 1::2] = -sign  # alternating: the halves' sums of opposite signs
        exact = x.double() @ dequantize(w).double().T
        got = qpanel.qpanel_matmul(lib, x, qpanel.to_panels(lib, w)).double()
        assert (got - exact).abs().max() <= 1e-5 * exact.abs().max(), (value, scale)


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS[:3])
def test_expert_panels_give_each_group_its_experts_product(
    lib: kernels.Library, bits: int, symmetric: bool
) -> None:
    # 6 experts of 64 rows: one gets no rows, one a single row, one 13 (three row blocks
    # and a partial one), one 41 (its panels unpacked once), the rest a few; each group's
    # rows equal the GEMM on that expert.
    e, n, k = 6, 64, 512
    w = k_quant(e * n, k, bits, symmetric, seed=2)
    panels = qpanel.to_panels(lib, w)
    ids = torch.tensor([[1]] + [[3]] * 13 + [[4], [5], [4]] + [[0]] * 41 + [[5]])
    groups = ExpertGroups.of(ids, e)
    assert 2 not in groups.expert.tolist()
    x = torch.randn(len(ids), k, generator=torch.Generator().manual_seed(3))[groups.order]
    got = qpanel.qpanel_experts(lib, x, panels, e, groups.start, groups.expert)
    for expert, lo, hi in groups.spans:
        part = qpanel.to_panels(lib, w.row_slice(expert * n, (expert + 1) * n))
        want = qpanel.qpanel_matmul(lib, x[lo:hi], part)  # (the GEMM's where gemm_sums)
        assert torch.equal(got[lo:hi], want), expert


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
def test_a_head_in_panels_is_the_head_with_the_gemms_first_level(
    lib: kernels.Library, bits: int, symmetric: bool
) -> None:
    # The output head on panels: the pick and every token that could round to it are
    # two-level (the candidates' rows rebuilt from the panels: the block kernel's on the
    # row-major weight), the rest the panel kernel's first level; where that is the
    # int8 GEMM's, every logit is bit for bit what the head computes on the row-major
    # weight with its first level from the GEMM. A row's logits do not depend on the
    # batch.
    w = k_quant(3008, 768, bits, symmetric, seed=4)
    panels = qpanel.to_panels(lib, w)
    weight = (*w.parts(), w.bits, w.group)
    row_norm = head_row_norms(lib, *weight)
    x = torch.randn(17, 768, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = qpanel.qpanel_matmul_head(lib, x, panels, row_norm)
    if qpanel.gemm_sums(lib):
        want = qblock.qblock_matmul_head(lib, x, *weight, row_norm, first_level="gemm")
        assert torch.equal(got, want)
    two = qblock.qblock_matmul_residual(lib, x, *weight)
    assert_two_level_where_it_may_be_picked(got, two, qpanel.qpanel_matmul(lib, x, panels))
    for rows in (1, 5, 16):
        assert torch.equal(qpanel.qpanel_matmul_head(lib, x[:rows], panels, row_norm), got[:rows])
    with pytest.raises(ValueError, match="panel order"):
        qpanel.qpanel_matmul_head(lib, x, w, row_norm)  # a row-major weight
    with pytest.raises(ValueError, match="row_norm"):
        qpanel.qpanel_matmul_head(lib, x, panels, row_norm[:-1])


def test_what_has_no_panel_layout_is_refused(lib: kernels.Library) -> None:
    q5 = random_weight(64, 256, 5, 32, 0, integer=True)
    q5k = QuantizedTensor(5, 32, q5.packed, q5.hbits, q5.d, q5.m, q5.s)
    with pytest.raises(ValueError, match="no panel layout"):
        qpanel.to_panels(lib, q5k)  # Q5_K
    with pytest.raises(ValueError, match="no panel layout"):
        qpanel.to_panels(lib, k_quant(48, 256, 4, False))  # rows not whole panels
    f = random_weight(64, 256, 4, 32, 0)  # float16 scales
    with pytest.raises(ValueError, match="no panel layout"):
        qpanel.to_panels(lib, QuantizedTensor(4, 32, f.packed, f.hbits, f.d, f.m, f.s))
    w = k_quant(64, 256, 4, False)
    panels = qpanel.to_panels(lib, w)
    with pytest.raises(ValueError, match="in panels"):
        panels.row_slice(0, 32)  # rows of a panel weight are not its rows
    with pytest.raises(ValueError, match="in panels"):
        dequantize(panels)
    with pytest.raises(ValueError, match="panel order"):
        qpanel.qpanel_matmul(lib, torch.randn(1, 256), w)  # a row-major weight
    with pytest.raises(ValueError, match="experts of panels"):
        qpanel.qpanel_experts(
            lib, torch.randn(1, 256), panels, 4, torch.tensor([0, 1]), torch.tensor([0])
        )


# OLMoE-1B-7B's and Llama-3.1-8B's shapes reduced (vocabulary, widths, experts).
TINY = {
    "tiny-olmoe": dataclasses.replace(
        SHAPES["olmoe-1b-7b"], hidden=256, ffn=256, heads=4, kv_heads=4, vocab=VOCAB, experts=8
    ),
    "tiny-llama": dataclasses.replace(
        SHAPES["llama-3.1-8b"], hidden=256, ffn=512, heads=4, kv_heads=2, vocab=VOCAB
    ),
    # Qwen2.5-3B's: the head is the embedding (tied).
    "tiny-qwen-tied": dataclasses.replace(
        SHAPES["qwen2.5-3b"], hidden=256, ffn=512, heads=4, kv_heads=2, vocab=VOCAB
    ),
}


@pytest.mark.parametrize("shape", sorted(TINY))
def test_a_model_keeps_its_k_quants_in_panels_where_the_level_uses_them(
    shape: str, tmp_path: Path, tokenizer: Path, kernel_level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three layers of the shape in llama-quantize's Q4_K_M: Q4_K, with Q6_K for attn_v
    # (the fused qkv widened to it) and ffn_down in one layer, and for the head. With
    # int8 prompts, at a level in PANEL_LEVELS every Q4_K and Q6_K linear, the head too
    # (HEAD_PANEL_LEVELS), and every such expert stack, is in panels, and the decode stack
    # (steps of up to 32 rows) gives eager's token ids and logprobs exactly.
    monkeypatch.setattr(random_gguf, "SHAPES", {**SHAPES, **TINY})
    path = tmp_path / f"{shape}.gguf"
    write_shaped(path, shape, layers=3, tokenizer_gguf=tokenizer)
    llm = LLM(model=str(path), quantization="gguf", dtype="bfloat16", kv_cache_memory=0.02,
              prompt_activations="int8")  # fmt: skip
    model = llm.engine.runner.model
    weights = []
    for layer in model.layers:
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        if llm.engine.model_config.is_moe:
            experts = layer.mlp.experts
            weights += [experts.gate_up_weight, experts.down_weight]
        else:
            linears += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        weights += [linear.method.weight for linear in linears]
    k_quants = {id(w) for w in weights if (w.bits, w.group) in qpanel.FORMATS and w.integer_scales}
    assert {(w.bits, w.group) for w in weights if id(w) in k_quants} == {(4, 32), (6, 16)}
    for w in weights:  # (8 experts: attention in Q8_0 and Q5_K, as llama-quantize does)
        assert w.panels == (id(w) in k_quants and kernel_level in PANEL_LEVELS)
    # The head (Q6_K) too, its kernel's first level from the panels; not a tied head,
    # whose rows the embedding reads.
    tied = llm.engine.model_config.tie_word_embeddings
    assert model.lm_head.method.weight.panels == (kernel_level in HEAD_PANEL_LEVELS and not tied)
    assert (model.lm_head.method.weight is model.embed_tokens.quantized) == tied
    del llm
    assert_stack_runs_the_gemm_as_eager(path)
