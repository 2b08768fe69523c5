"""The experts' matmul (sluice_qblock_matmul_experts, a Mixture-of-Experts layer's
projection over E experts stacked in one qblock weight [E * N, K]) at every
instruction-set level this CPU has: each group of rows is bit for bit qblock_matmul on
its expert's row slice (the same kernel, the same passes), and within the int8 kernel's
bound of x @ W.T with W from sluice.core.quantized_tensor.dequantize, for every format,
fp32 and bf16, groups of 0, 1 and more rows than a pass takes, a decode step's top-8,
expert ids in any order; bad groupings are refused before C is called."""

from __future__ import annotations

import pytest
import torch

from sluice import kernels
from sluice.core.quantized_tensor import QuantizedTensor, dequantize
from sluice.kernels import qblock
from tests.test_qblock_kernels import (
    CASES,
    Weight,
    assert_close,
    block_steps,
    columns,
    int8_grid,
    random_weight,
    span,
)

EXPERTS, N = 10, 24  # experts, and each one's rows


@pytest.fixture
def lib(kernel_level: str) -> kernels.Library:
    loaded = kernels.load()
    assert loaded is not None and kernels.built_level(loaded) == kernel_level
    return loaded


def groups(counts: list[int], experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(group_start, group_expert) of groups of `counts` rows."""
    start = torch.tensor([0, *counts]).cumsum(0)
    return start, torch.tensor(experts, dtype=torch.int64)


def layouts(row_block: int) -> list[tuple[list[int], list[int]]]:
    """(rows a group, expert a group): groups of 0, 1, a few, and more rows than one
    pass of the kernel serves (several passes), experts unsorted and one repeated; and a
    decode step: one token's 8 experts, a row each."""
    many = 2 * row_block + 1
    mixed = ([2, 0, many, 1, 0, 5, 3], [7, 1, 3, 9, 0, 0, 4])
    top8 = ([1] * 8, [5, 2, 9, 0, 3, 6, 1, 8])
    return [mixed, top8]


def stacked(w: Weight) -> QuantizedTensor:
    return QuantizedTensor(w.bits, w.group, w.packed, w.hbits, w.d, w.m, w.s)


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_group_is_qblock_matmul_on_its_expert(
    bits: int, group: int, symmetric: bool, integer: bool, dtype: torch.dtype, lib: kernels.Library
) -> None:
    k = columns(integer)
    w = random_weight(EXPERTS * N, k, bits, group, 3 * bits + group, symmetric, integer)
    weight = w.rows(0, EXPERTS * N)
    dense = dequantize(stacked(w)).double().view(EXPERTS, N, k)
    gen = torch.Generator().manual_seed(bits + group)
    for counts, experts in layouts(qblock.row_block(lib)):
        start, expert = groups(counts, experts)
        m = sum(counts)
        token = torch.randn(1, k, generator=gen).to(dtype)
        off_grid = (
            token.expand(m, k) if counts == [1] * 8 else torch.randn(m, k, generator=gen).to(dtype)
        )
        grid = int8_grid(m, k, dtype, seed=m + bits, block=span(integer))
        for x in (off_grid, grid):
            got = qblock.qblock_matmul_experts(lib, x, *weight, bits, group, EXPERTS, start, expert)
            assert got.dtype == dtype and got.shape == (m, N)
            for j, e in enumerate(experts):
                a, b = int(start[j]), int(start[j + 1])
                alone = qblock.qblock_matmul(lib, x[a:b], *w.rows(e * N, (e + 1) * N), bits, group)
                assert torch.equal(got[a:b], alone), (j, e)
                ref, size = (
                    x[a:b].double() @ dense[e].t(),
                    x[a:b].double().abs() @ dense[e].abs().t(),
                )
                if x is grid:  # int8 blocks hold the rows exactly: fp32 rounding only
                    assert_close(got[a:b], ref, size, 1e-5)
                else:  # each value rounded to its block's int8 step: half a step at most
                    steps = block_steps(x[a:b], span(integer)) * 0.505
                    assert_close(got[a:b], ref, steps @ dense[e].abs().t() + 1e-5 * size, 1.0)


def test_no_rows_make_an_empty_result(kernel_level: str) -> None:
    lib = kernels.load()
    assert lib is not None
    w = random_weight(EXPERTS * N, 64, 4, 32, seed=1)
    for counts in ([], [0, 0]):
        start, expert = groups(counts, [3] * len(counts))
        x = torch.empty(0, 64)
        got = qblock.qblock_matmul_experts(
            lib, x, *w.rows(0, EXPERTS * N), 4, 32, EXPERTS, start, expert
        )
        assert got.shape == (0, N)


def test_bad_groupings_are_refused(kernel_level: str) -> None:
    lib = kernels.load()
    assert lib is not None
    w = random_weight(EXPERTS * N, 64, 4, 32, seed=0)
    weight = w.rows(0, EXPERTS * N)
    x = torch.randn(3, 64)
    start, expert = groups([2, 1], [4, 0])

    def call(
        x: torch.Tensor = x,
        bits: int = 4,
        num_experts: int = EXPERTS,
        group_start: torch.Tensor = start,
        group_expert: torch.Tensor = expert,
    ) -> torch.Tensor:
        return qblock.qblock_matmul_experts(
            lib, x, *weight, bits, 32, num_experts, group_start, group_expert
        )

    assert call().shape == (3, N)  # the baseline is fine
    with pytest.raises(ValueError, match="7 bits"):
        call(bits=7)
    with pytest.raises(ValueError, match="x must be"):
        call(x=torch.randn(3, 128))
    with pytest.raises(ValueError, match="x must be"):
        call(x=x.half())
    for e in (0, 7, -2):  # the rows must split evenly into experts
        with pytest.raises(ValueError, match="experts"):
            call(num_experts=e)
    with pytest.raises(ValueError, match="int64"):
        call(group_start=start.int())
    with pytest.raises(ValueError, match="int64"):
        call(group_expert=expert.int())
    with pytest.raises(ValueError, match="int64"):
        call(group_start=torch.tensor([0, 0, 2, 2, 3])[::2])  # not contiguous
    with pytest.raises(ValueError, match="one more"):
        call(group_start=torch.tensor([0, 3]))
    for bounds in ([1, 2, 3], [0, 2, 2], [0, 2, 4], [0, 4, 3]):  # from 0, to M, rising
        with pytest.raises(ValueError, match="rise from 0"):
            call(group_start=torch.tensor(bounds))
    for ids in ([4, EXPERTS], [-1, 0]):
        with pytest.raises(ValueError, match="group_expert ids"):
            call(group_expert=torch.tensor(ids))
