"""The qblock kernels (sluice/kernels/csrc/qblock*.h) at every instruction-set level
this CPU has, against a pure-torch packer and dequantizer written from the layout spec
(issue 13, csrc/qblock.h): dequantization and embedding rows exact, the unquantized
matmul to fp32 rounding, the int8-activation matmul on activations its int8 blocks hold
exactly, for every format (float16 scales, and integer scales with float16 multipliers
per 256 values where the K-quants' layouts have them) and a spread of row counts in
fp32 and bf16."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sluice import kernels
from sluice.core.quantized_tensor import INTEGER_SCALE_LAYOUTS
from sluice.kernels import qblock
from tests.conftest import kernels_at

# (bits, group): 4, 5, 6 and 8 bits in groups of 16 and 32, and MXFP4's E2M1 codes in 32s
FORMATS = sorted(qblock.FORMATS)
E2M1 = 20  # the kernels' code for MXFP4's codes (csrc/qblock.h's kQbE2M1)
# Each code's value u: the E2M1 number (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5,
# 1, 1.5, 2, 3, 4, 6) doubled, plus 16; the weight's offset is then -16 scales.
E2M1_U = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]) + 16
ROWS = (1, 3, 4, 7, 64, 130)


def natural_of_position() -> torch.Tensor:
    """Natural index (within a pair of 32-blocks) of each of the pair's 64 positions:
    b0[0..15], b1[0..15], b0[16..31], b1[16..31]."""
    runs = [range(0, 16), range(32, 48), range(16, 32), range(48, 64)]
    return torch.tensor([k for run in runs for k in run])


@dataclass
class Weight:
    u: torch.Tensor  # [N, K] int64, natural order (E2M1: the codes)
    d: torch.Tensor  # [N, K / G] fp16, or int8 (integer scales)
    m: torch.Tensor  # as d; empty for a symmetric weight: m = -2**(bits - 1) * d (E2M1: -16 d)
    s: torch.Tensor  # integer scales: fp16 [N, 1 or 2, K / 256] multipliers of d (and m)
    bits: int
    group: int
    packed: torch.Tensor
    hbits: torch.Tensor

    def scales(self, t: torch.Tensor, which: int) -> torch.Tensor:
        """d (which 0) or m (1) per group as fp32: times its multiplier if integer."""
        if not self.s.numel():
            return t.float()
        return t.float() * self.s[:, which].float().repeat_interleave(256 // self.group, dim=1)

    def dense(self) -> torch.Tensor:
        """W = d * u + m per group, exactly as the spec writes it, rounded once to fp32."""
        return self.terms()[0].float()

    def terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W (fp64, exact) and |d * u| + |m| per weight."""
        n, k = self.u.shape
        g = self.group
        u = (E2M1_U[self.u] if self.bits == E2M1 else self.u).double().view(n, k // g, g)
        d = self.scales(self.d, 0).double()
        implied = -16.0 if self.bits == E2M1 else -(2.0 ** (self.bits - 1))
        m = self.scales(self.m, 1).double() if self.m.numel() else implied * d
        du = d[..., None] * u
        return (du + m[..., None]).view(n, k), (du.abs() + m.abs()[..., None]).view(n, k)

    def rows(self, a: int, b: int) -> tuple[torch.Tensor, ...]:
        """Row slices of the kernel's five tensors (empty hbits, m and s stay empty)."""

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[a:b] if t.numel() else t

        return self.packed[a:b], cut(self.hbits), self.d[a:b], cut(self.m), cut(self.s)


def pack(
    u: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    bits: int,
    group: int,
    s: torch.Tensor | None = None,
) -> Weight:
    n, k = u.shape
    pos = u.view(n, k // 64, 64)[..., natural_of_position()]  # position order per pair
    hbits = torch.empty(0, dtype=torch.uint8)
    if bits == 8:
        packed = pos.reshape(n, k)
    else:
        low = pos & 15  # byte j: position j low nibble, position 32 + j high nibble
        packed = (low[..., :32] | (low[..., 32:] << 4)).reshape(n, k // 2)
        if bits == 5:  # bit i of the pair's little-endian uint64: bit 4 of position i
            fifth = ((pos >> 4) & 1).view(n, k // 64, 8, 8)
            hbits = (fifth << torch.arange(8)).sum(-1).reshape(n, k // 8).to(torch.uint8)
        if bits == 6:  # byte i of a pair's 16: bits 4-5 of position 16 j + i at bits 2j..
            high = ((pos >> 4) & 3).view(n, k // 64, 4, 16)
            shifted = high << (2 * torch.arange(4)).view(4, 1)
            hbits = shifted.sum(2).reshape(n, k // 4).to(torch.uint8)
    s = torch.empty(0, dtype=torch.float16) if s is None else s
    return Weight(u, d, m, s, bits, group, packed.to(torch.uint8).contiguous(), hbits)


def random_weight(
    n: int,
    k: int,
    bits: int,
    group: int,
    seed: int,
    symmetric: bool = False,
    integer: bool = False,
) -> Weight:
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16 if bits == E2M1 else 1 << bits, (n, k), generator=gen)
    if integer:  # as the K-quants: int8 scales (signed, as Q6_K's) and offsets
        d = torch.randint(-128, 128, (n, k // group), generator=gen).to(torch.int8)
        m = torch.randint(-128, 128, (n, k // group), generator=gen).to(torch.int8)
        s = (torch.rand(n, 1 if symmetric else 2, k // 256, generator=gen) * 2e-4 + 1e-5).half()
        return pack(u, d, m[:0] if symmetric else m, bits, group, s)
    d = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).half()
    m = (torch.randn(n, k // group, generator=gen) * 0.1).half()
    return pack(u, d, torch.empty(0, dtype=torch.float16) if symmetric else m, bits, group)


# Every format with float16 scales, symmetric (no stored m) or not, and the K-quants'
# layouts with integer scales; (bits, group, symmetric, integer).
CASES = [(b, g, sym, False) for b, g in FORMATS for sym in (False, True)] + [
    (b, g, sym, True) for b, g in sorted(INTEGER_SCALE_LAYOUTS) for sym in (False, True)
]


def columns(integer: bool) -> int:
    """K for the exactness tests: 3 pairs, or 3 super-blocks for integer scales (so
    the kernels' 16-group steps over the offsets end on a partial one)."""
    return 768 if integer else 192


def span(integer: bool) -> int:
    """Values under one activation scale: a block of 32, or for a weight with integer
    scales its super-block of 256 (the kernels sum a super-block in int32)."""
    return 256 if integer else 32


def int8_grid(rows: int, k: int, dtype: torch.dtype, seed: int, block: int = 32) -> torch.Tensor:
    """Rows on the int8 grid of their blocks (an integer times a power of two, 127 in
    each block): quantize_rows keeps them exactly, so the int8-activation matmul can be
    held to fp32 rounding. Off the grid, values within an ulp of a rounding tie (common
    in bf16) go the way the kernel's fast-math reciprocal sends them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, k // block, block), generator=gen)
    q[..., 0] = 127
    scale = 2.0 ** torch.randint(-8, 1, (rows, k // block, 1), generator=gen)
    return (q * scale).view(rows, k).to(dtype)


@pytest.fixture
def lib(kernel_level: str) -> kernels.Library:
    loaded = kernels.load()
    assert loaded is not None and kernels.built_level(loaded) == kernel_level
    return loaded


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
def test_dequantize_and_embedding_are_exact(
    bits: int, group: int, symmetric: bool, integer: bool, lib: kernels.Library
) -> None:
    k = columns(integer)
    w = random_weight(40, k, bits, group, seed=bits * group, symmetric=symmetric, integer=integer)
    ref, size = w.terms()

    def check(got: torch.Tensor, rows: torch.Tensor | slice) -> None:
        if integer:  # d has up to 19 significant bits, d * u up to 27: one FMA rounds
            # once, the generic level (no FMA) twice: within 2**-23 of the terms.
            assert_close(got, ref[rows], size[rows], 2**-23)
        else:  # d * u is exact in fp32: one rounding at every level
            assert torch.equal(got, ref[rows].float().to(got.dtype))

    ids = torch.tensor([3, 0, 39, 3, 17])
    for dtype in (torch.float32, torch.bfloat16):
        check(qblock.qblock_dequantize(lib, *w.rows(0, 40), bits, group, dtype), slice(None))
        check(qblock.qblock_embedding(lib, ids, *w.rows(0, 40), bits, group, dtype), ids)
    # Row slices are weights too.
    check(qblock.qblock_dequantize(lib, *w.rows(5, 21), bits, group, torch.float32), slice(5, 21))


def assert_close(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, rel: float) -> None:
    """|got - ref| within rel * bound (a per-element magnitude of the sum's terms), plus
    bf16's rounding of the result where got is bf16."""
    tol = rel * bound
    if got.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2**-8
    err = (got.double() - ref).abs()
    assert bool((err <= tol + 1e-12).all()), float((err / (tol + 1e-12)).max())


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmuls_match_the_reference(
    bits: int, group: int, symmetric: bool, integer: bool, dtype: torch.dtype, lib: kernels.Library
) -> None:
    # 61 weight rows: one whole 32-row GEMM panel and one with 16 + 13 (the GEMM packs
    # 16 rows at a time).
    n, k = 61, columns(integer)
    w = random_weight(n, k, bits, group, 7 * bits + group, symmetric, integer)
    dense = w.dense().double()
    abs_w = dense.abs().t()
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(group)).to(dtype)
    grid = int8_grid(max(ROWS), k, dtype, seed=group, block=span(integer))
    for rows in ROWS:
        got = qblock.qblock_matmul_float(lib, x[:rows], *w.rows(0, n), bits, group)
        assert got.dtype == dtype
        assert_close(got, x[:rows].double() @ dense.t(), x[:rows].double().abs() @ abs_w, 1e-5)
        for matmul in (qblock.qblock_matmul, qblock.qblock_gemm):
            got = matmul(lib, grid[:rows], *w.rows(0, n), bits, group)
            assert_close(
                got, grid[:rows].double() @ dense.t(), grid[:rows].double().abs() @ abs_w, 1e-5
            )


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
def test_amx_matmul_is_the_dense_bf16_product(
    bits: int, group: int, symmetric: bool, integer: bool
) -> None:
    # The AMX kernel computes what the dense path does: bf16 activations times the weight
    # dequantized to bf16, summed in fp32 (exact products; only the order of the sums
    # and the bf16 result's rounding differ). Row counts that fill one or two 16-row
    # tiles or leave part of one, and a panel's columns past N (40 = 32 + 8).
    with kernels_at("amx"):
        lib = kernels.load()
        assert lib is not None and kernels.tiles(lib)
        n, k = 40, columns(integer)
        w = random_weight(n, k, bits, group, 3 * bits + group, symmetric, integer)
        w16 = qblock.qblock_dequantize(lib, *w.rows(0, n), bits, group, torch.bfloat16).double()
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(bits)).bfloat16()
        for rows in (1, 15, 16, 17, 33, 70):
            before = qblock.amx_calls(lib)
            got = qblock.qblock_amx(lib, x[:rows], *w.rows(0, n), bits, group)
            assert qblock.amx_calls(lib) > before  # the tiles ran
            xr = x[:rows].double()
            assert_close(got, xr @ w16.t(), xr.abs() @ w16.abs().t(), 1e-5)
        with pytest.raises(ValueError, match="bf16"):
            qblock.qblock_amx(lib, x.float(), *w.rows(0, n), bits, group)


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_on_amx_tiles_is_the_vnni_gemm_bit_for_bit(
    bits: int, group: int, symmetric: bool, integer: bool, dtype: torch.dtype
) -> None:
    # The tile path makes the VNNI GEMM's integer sums and applies the scales in its
    # order, so the two agree exactly (and the VNNI GEMM is held to the reference
    # above). Off-grid activations (rounding ties too), row counts under, at and past
    # a 16-row block, and weight rows past a 16-row pass (40 = 16 + 16 + 8).
    with kernels_at("amx"):
        lib = kernels.load()
        assert lib is not None and kernels.tiles(lib)
        n, k = 40, columns(integer)
        w = random_weight(n, k, bits, group, 5 * bits + group, symmetric, integer)
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(bits + group)).to(dtype)
        x[3, : k // 2] = 0  # a row with all-zero spans (scale 0)
        for rows in (1, 12, 16, 17, 33, 70):
            vnni = qblock.qblock_gemm(lib, x[:rows], *w.rows(0, n), bits, group)
            before = qblock.amx_int8_calls(lib)
            got = qblock.qblock_gemm(lib, x[:rows], *w.rows(0, n), bits, group, tiles=True)
            assert qblock.amx_int8_calls(lib) > before  # the tiles ran
            assert torch.equal(got, vnni), (rows, (got - vnni).abs().max())


def block_steps(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each value's int8 block step (its block's largest magnitude / 127)."""
    rows, k = x.shape
    amax = x.double().abs().view(rows, k // block, block).amax(-1, keepdim=True)
    return (amax / 127).expand(rows, k // block, block).reshape(rows, k)


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_matmul_keeps_activations_to_a_fraction_of_their_step(
    bits: int, group: int, symmetric: bool, integer: bool, dtype: torch.dtype, lib: kernels.Library
) -> None:
    # Off the int8 grid (where one level rounds each value by up to half a step), the
    # two-level activations are off by at most half a step of the residual's own
    # blocks, itself at most half a step: 1/254 of the first level's error bound.
    n, k = 24, columns(integer)
    w = random_weight(n, k, bits, group, 5 * bits + group, symmetric, integer)
    dense = w.dense().double()
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3)).to(dtype)
    for rows in ROWS:
        xr = x[:rows]
        got = qblock.qblock_matmul_residual(lib, xr, *w.rows(0, n), bits, group)
        ref = xr.double() @ dense.t()
        # |dx error| <= step / 2 / 254 (+ a little for the residual's own fp32
        # rounding); the fp32 sums add their 1e-5 relative.
        bound = (block_steps(xr, span(integer)) / 500) @ dense.abs().t()
        assert_close(got, ref, bound + 1e-5 * (xr.double().abs() @ dense.abs().t()), 1.0)
        if dtype == torch.float32:  # (bf16's rounding of the result hides the gain)
            one_level = qblock.qblock_matmul(lib, xr, *w.rows(0, n), bits, group)
            gain = (one_level.double() - ref).abs().sum() / (got.double() - ref).abs().sum()
            assert gain > 20


def head_row_norms(lib: kernels.Library, *weight: Any) -> torch.Tensor:
    """Each weight row's L2 norm, rounded up, as the model's head computes it
    (block_quant.row_norms)."""
    dense = qblock.qblock_dequantize(lib, *weight, torch.float32).double()
    return (torch.linalg.vector_norm(dense, dim=1) * (1 + 1e-6)).float()


def assert_two_level_where_it_may_be_picked(
    got: torch.Tensor, two: torch.Tensor, one: torch.Tensor
) -> None:
    """The head's logits `got` are each bit for bit the two-level one (`two`) or the
    one-level one (`one`); the greedy pick and every token that could round to its value
    are two-level; most tokens are one-level (the second level was not paid for
    everywhere)."""
    exact = got == two
    assert (exact | (got == one)).all()
    assert torch.equal(got.float().argmax(1), two.float().argmax(1))
    top = two.float().amax(1, keepdim=True)
    assert (two.float()[~exact] < top.expand_as(two)[~exact]).all()  # none left out ties
    assert (~exact).float().mean() > 0.5


def head_kernel(lib: kernels.Library, x: torch.Tensor, *weight: Any) -> torch.Tensor:
    """qblock_matmul_head with the row norms computed as the model's head does."""
    return qblock.qblock_matmul_head(lib, x, *weight, head_row_norms(lib, *weight))


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_matmul_is_the_residual_one_for_every_token_that_may_be_picked(
    bits: int, group: int, symmetric: bool, integer: bool, dtype: torch.dtype, lib: kernels.Library
) -> None:
    # Every logit is bit for bit the two-level one or the one-level one; the greedy pick
    # and every token that could round to its value are two-level; and the rows far
    # from the top (most of a 3000-token vocabulary here) are one-level.
    n, k = 3000, columns(integer)
    w = random_weight(n, k, bits, group, 7 * bits + group, symmetric, integer)
    weight = (*w.rows(0, n), bits, group)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = head_kernel(lib, x, *weight)
    two = qblock.qblock_matmul_residual(lib, x, *weight)
    one = qblock.qblock_matmul(lib, x, *weight)
    assert_two_level_where_it_may_be_picked(got, two, one)
    for rows in (1, 5, 12):  # a row's logits do not depend on the batch
        assert torch.equal(head_kernel(lib, x[:rows], *weight), got[:rows])
        assert torch.equal(head_kernel(lib, x[rows : rows + 1], *weight), got[rows : rows + 1])


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
def test_head_with_the_gemms_first_level_keeps_candidates_two_level_and_the_rest_the_gemms(
    bits: int, group: int, symmetric: bool, integer: bool, lib: kernels.Library
) -> None:
    # With its first level from the int8 GEMM (VNNI at avx512, portable loops below),
    # every logit is bit for bit the two-level one or that GEMM's; the pick and every
    # token that could round to it are two-level; a row's logits do not depend on the
    # batch.
    n, k = 3000, columns(integer)
    w = random_weight(n, k, bits, group, 7 * bits + group, symmetric, integer)
    weight = (*w.rows(0, n), bits, group)
    row_norm = head_row_norms(lib, *weight)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = qblock.qblock_matmul_head(lib, x, *weight, row_norm, first_level="gemm")
    two = qblock.qblock_matmul_residual(lib, x, *weight)
    one = qblock.qblock_gemm(lib, x, *weight)
    assert_two_level_where_it_may_be_picked(got, two, one)
    for rows in (1, 16):
        part = qblock.qblock_matmul_head(lib, x[:rows], *weight, row_norm, first_level="gemm")
        assert torch.equal(part, got[:rows])
    with pytest.raises(ValueError, match="first_level"):
        qblock.qblock_matmul_head(lib, x, *weight, row_norm, first_level="tile")  # type: ignore[arg-type]


@pytest.mark.parametrize(("bits", "group", "symmetric", "integer"), CASES)
def test_head_on_amx_tiles_keeps_candidates_two_level_and_the_rest_the_gemms(
    bits: int, group: int, symmetric: bool, integer: bool
) -> None:
    # With its first level from the int8 GEMM on tiles, every logit is bit for bit the
    # two-level one or that GEMM's; the pick and every token that could round to it are
    # two-level (their first level again from the block kernel, as before); a row's
    # logits do not depend on the batch.
    with kernels_at("amx"):
        lib = kernels.load()
        assert lib is not None and kernels.tiles(lib)
        n, k = 3000, columns(integer)
        w = random_weight(n, k, bits, group, 7 * bits + group, symmetric, integer)
        weight = (*w.rows(0, n), bits, group)
        row_norm = head_row_norms(lib, *weight)
        x = torch.randn(17, k, generator=torch.Generator().manual_seed(5)).bfloat16()
        before = qblock.amx_int8_calls(lib)
        got = qblock.qblock_matmul_head(lib, x, *weight, row_norm, first_level="tiles")
        assert qblock.amx_int8_calls(lib) > before
        two = qblock.qblock_matmul_residual(lib, x, *weight)
        one = qblock.qblock_gemm(lib, x, *weight, tiles=True)
        assert_two_level_where_it_may_be_picked(got, two, one)
        for rows in (1, 16):
            part = qblock.qblock_matmul_head(lib, x[:rows], *weight, row_norm, first_level="tiles")
            assert torch.equal(part, got[:rows])


@pytest.mark.parametrize(
    ("bits", "group", "integer"),
    [(4, 32, False), (5, 16, False), (6, 16, False), (8, 16, False), (4, 32, True), (6, 16, True)],
)
def test_matmul_rows_do_not_depend_on_the_batch(
    bits: int, group: int, integer: bool, lib: kernels.Library
) -> None:
    # A row's result is bit-identical alone or in any batch: the decode stack and the
    # eager model call the kernel with different row counts. K = 4096 tiles 130 rows
    # (64 a tile), so tile edges are crossed too; the weight is a row slice.
    n, k = 10, 4096
    w = random_weight(n + 3, k, bits, group, seed=11, integer=integer)
    weight = w.rows(3, n + 3)
    x = torch.randn(130, k)
    for fn in (qblock.qblock_matmul, qblock.qblock_matmul_float, qblock.qblock_matmul_residual):
        batch = fn(lib, x, *weight, bits, group)
        for r in (0, 1, 63, 64, 65, 129):
            assert torch.equal(fn(lib, x[r : r + 1], *weight, bits, group), batch[r : r + 1])
        for rows in (2, 5, 9, 12, 13, 25):  # one pass of a row block, and several
            assert torch.equal(fn(lib, x[:rows], *weight, bits, group), batch[:rows])
    grid = int8_grid(130, k, torch.float32, seed=12, block=span(integer)).double()
    dense = w.dense()[3:].double()
    got = qblock.qblock_matmul(lib, grid.float(), *weight, bits, group)
    assert_close(got, grid @ dense.t(), grid.abs() @ dense.abs().t(), 1e-5)


def test_bad_formats_and_shapes_are_refused(kernel_level: str) -> None:
    lib = kernels.load()
    assert lib is not None
    w = random_weight(4, 64, 4, 32, seed=0)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="7 bits"):
        qblock.qblock_matmul(lib, x, *w.rows(0, 4), 7, 32)
    with pytest.raises(ValueError, match="shapes"):
        qblock.qblock_matmul(lib, x, *w.rows(0, 4), 4, 16)
    for bits in (5, 6):  # their high bits are missing
        with pytest.raises(ValueError, match="hbits"):
            qblock.qblock_matmul(lib, x, *w.rows(0, 4), bits, 32)
    with pytest.raises(ValueError, match="x must be"):
        qblock.qblock_matmul(lib, torch.randn(1, 128), *w.rows(0, 4), 4, 32)
    with pytest.raises(IndexError):
        qblock.qblock_embedding(lib, torch.tensor([4]), *w.rows(0, 4), 4, 32, torch.float32)
    # Integer scales: int8 with float16 multipliers, in the K-quants' layouts only.
    wi = random_weight(4, 256, 4, 32, seed=0, integer=True)
    xi = torch.randn(1, 256)
    with pytest.raises(ValueError, match="int8"):
        qblock.qblock_matmul(lib, xi, wi.packed, wi.hbits, wi.d.half(), wi.m.half(), wi.s, 4, 32)
    with pytest.raises(ValueError, match="float16"):
        qblock.qblock_matmul(lib, xi, wi.packed, wi.hbits, wi.d, wi.m, wi.s[:, :1], 4, 32)
    w8 = random_weight(4, 256, 8, 32, seed=0, integer=False)
    with pytest.raises(ValueError, match="integer scales at 8/32"):
        qblock.qblock_matmul(lib, xi, w8.packed, w8.hbits, wi.d, wi.m, wi.s, 8, 32)


@pytest.mark.parametrize(("type_name", "block_rows"), [("Q4_K", 32), ("Q4_0", 16)])
def test_few_rows_take_the_block_kernel_up_to_the_crossover(
    type_name: str, block_rows: int, kernel_level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF linear runs M rows on the block kernel (int8 activations, bit for bit the
    kernel's output) below dense_min_rows and on dequantized tiles + GEMM from there:
    32 rows for the K-quants' integer scales, 16 for fp16 scales (avx2 and avx512). The
    output head stays on its kernel at avx2, and at avx512 without AMX tiles, where its
    first level takes the VNNI GEMM from HEAD_GEMM_MIN_ROWS; elsewhere its crossover is
    its format's."""
    from sluice.core.quantized_tensor import dequantize
    from sluice.layers.block_quant import (
        HEAD_GEMM_MIN_ROWS,
        BlockQuantized,
        dense_min_rows,
        head_first_level,
    )
    from sluice.layers.linear import Linear
    from sluice.loader.gguf_blocks import repack
    from tests.test_gguf_blocks import random_blocks

    raw = torch.from_numpy(random_blocks(type_name, 64, 512, seed=5))
    weight = repack(raw, type_name, 64, 512)
    if kernel_level == "generic":
        assert dense_min_rows(weight) == 4
        return
    assert dense_min_rows(weight) == block_rows
    layer = Linear(512, 64, bias=False, method=BlockQuantized())
    layer.method.load_quantized(layer, weight)
    head = Linear(512, 64, bias=False, method=BlockQuantized(output_head=True))
    head.method.load_quantized(head, weight)
    gemm_head = kernel_level in HEAD_GEMM_MIN_ROWS and not kernels.tiles()
    head_stays = kernel_level == "avx2" or gemm_head
    assert head.method.dense_min_rows == (sys.maxsize if head_stays else block_rows)
    gen = torch.Generator().manual_seed(0)
    lib = kernels.load()
    assert lib is not None
    firsts: list[str] = []
    head_kernel = qblock.qblock_matmul_head
    monkeypatch.setattr(
        qblock,
        "qblock_matmul_head",
        lambda *a, **kw: firsts.append(kw.get("first_level", "blocks")) or head_kernel(*a, **kw),
    )
    if gemm_head:
        gemm_from = HEAD_GEMM_MIN_ROWS[kernel_level]
        for rows in (gemm_from - 1, gemm_from):
            head(torch.randn(rows, 512, generator=gen))
        assert firsts == ["blocks", "gemm"]
    for rows in (block_rows - 1, block_rows):
        x = torch.randn(rows, 512, generator=gen)
        y = layer(x)
        on_blocks = qblock.qblock_matmul(lib, x, *weight.parts(), weight.bits, weight.group)
        dense = x @ dequantize(weight, torch.float32).T
        if rows < block_rows:
            assert torch.equal(y, on_blocks)
        else:
            torch.testing.assert_close(y, dense, rtol=1e-4, atol=1e-4)
            assert not torch.equal(y, on_blocks)
        row_norm = head.method.row_norm
        assert row_norm is not None
        on_head_kernel = head_kernel(
            lib, x, *weight.parts(), weight.bits, weight.group, row_norm,
            first_level=head_first_level(lib, rows),
        )  # fmt: skip
        assert torch.equal(head(x), on_head_kernel) == (rows < block_rows or head_stays)


@pytest.mark.parametrize("int8_prompts", [False, True])
def test_many_bf16_rows_take_the_amx_kernel_at_the_amx_level(int8_prompts: bool) -> None:
    """At the amx level a GGUF linear's bf16 rows past its crossover run on the AMX
    kernel in the dense path's place, and in the int8 GEMM's from
    AMX_AFTER_GEMM_MIN_ROWS; few rows and fp32 rows keep their paths, and so does
    everything at a forced avx512 level."""
    from sluice.layers.block_quant import AMX_AFTER_GEMM_MIN_ROWS, BlockQuantized
    from sluice.layers.linear import Linear
    from sluice.loader.gguf_blocks import repack
    from tests.test_gguf_blocks import random_blocks

    weight = repack(torch.from_numpy(random_blocks("Q4_K", 80, 512, seed=2)), "Q4_K", 80, 512)
    gen = torch.Generator().manual_seed(0)
    for level in ("amx", "avx512"):
        with kernels_at(level):
            layer = Linear(512, 80, bias=False, method=BlockQuantized(int8_prompts=int8_prompts))
            layer.method.load_quantized(layer, weight)
            lib = kernels.load()
            assert lib is not None
            start = layer.method.dense_min_rows
            for rows, dtype in [
                (start - 1, torch.bfloat16),
                (start, torch.bfloat16),
                (AMX_AFTER_GEMM_MIN_ROWS, torch.bfloat16),
                (AMX_AFTER_GEMM_MIN_ROWS, torch.float32),
            ]:
                x = torch.randn(rows, 512, generator=gen).to(dtype)
                before = qblock.amx_calls(lib)
                y = layer(x)
                on_tiles = qblock.amx_calls(lib) > before
                amx_rows = AMX_AFTER_GEMM_MIN_ROWS if int8_prompts else start
                expected = level == "amx" and dtype == torch.bfloat16 and rows >= amx_rows
                assert on_tiles == expected, (level, rows, dtype)
                if expected:
                    amx = qblock.qblock_amx(lib, x, *weight.parts(), weight.bits, weight.group)
                    assert torch.equal(y, amx)


def test_the_int8_gemm_and_the_heads_first_level_take_amx_int8_tiles_at_the_amx_level() -> None:
    """At the amx level a linear with int8 prompts runs its GEMM rows (GEMM_MIN_ROWS up
    to AMX_AFTER_GEMM_MIN_ROWS) on the int8 tiles, and the output head its rows from
    HEAD_TILES_MIN_ROWS below its dense crossover; a forced avx512 level never does (the
    head's rows take the VNNI GEMM there)."""
    from sluice.layers.block_quant import (
        AMX_AFTER_GEMM_MIN_ROWS,
        GEMM_MIN_ROWS,
        HEAD_TILES_MIN_ROWS,
        BlockQuantized,
    )
    from sluice.layers.linear import Linear
    from sluice.loader.gguf_blocks import repack
    from tests.test_gguf_blocks import random_blocks

    weight = repack(torch.from_numpy(random_blocks("Q6_K", 80, 512, seed=4)), "Q6_K", 80, 512)
    gen = torch.Generator().manual_seed(0)
    for level in ("amx", "avx512"):
        with kernels_at(level):
            lib = kernels.load()
            assert lib is not None
            layer = Linear(512, 80, bias=False, method=BlockQuantized(int8_prompts=True))
            head = Linear(512, 80, bias=False, method=BlockQuantized(output_head=True))
            for linear in (layer, head):
                linear.method.load_quantized(linear, weight)
            gemm_from = GEMM_MIN_ROWS["avx512"]
            for linear, rows, expected in [
                (layer, gemm_from - 1, False),
                (layer, gemm_from, True),
                (layer, AMX_AFTER_GEMM_MIN_ROWS - 1, True),
                (head, HEAD_TILES_MIN_ROWS - 1, False),
                (head, HEAD_TILES_MIN_ROWS, True),
            ]:
                x = torch.randn(rows, 512, generator=gen).bfloat16()
                before = qblock.amx_int8_calls(lib)
                y = linear(x)
                on_tiles = qblock.amx_int8_calls(lib) > before
                assert on_tiles == (expected and level == "amx"), (level, rows)
            args = (*weight.parts(), weight.bits, weight.group)
            first = "tiles" if level == "amx" else "gemm"
            assert torch.equal(y, qblock.qblock_matmul_head(lib, x, *args, head.method.row_norm,
                                                            first_level=first))  # fmt: skip


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_int8_prompts_take_the_gemm_past_the_crossover(type_name: str, kernel_level: str) -> None:
    """With int8_prompts a GGUF linear runs its many-row calls on the int8 GEMM (bit for
    bit its output, near the dense product) where the level has it (avx512), on the
    block kernel at every row count at avx2, on dequantized tiles at generic; the output
    head never takes the GEMM."""
    from sluice.core.quantized_tensor import dequantize
    from sluice.layers.block_quant import INT8_GEMM_LEVELS, INT8_PROMPTS_ON_BLOCKS, BlockQuantized
    from sluice.layers.linear import Linear
    from sluice.loader.gguf_blocks import repack
    from tests.test_gguf_blocks import random_blocks

    raw = torch.from_numpy(random_blocks(type_name, 80, 512, seed=9))
    weight = repack(raw, type_name, 80, 512)
    layer = Linear(512, 80, bias=False, method=BlockQuantized(int8_prompts=True))
    layer.method.load_quantized(layer, weight)
    head = Linear(512, 80, bias=False, method=BlockQuantized(output_head=True, int8_prompts=True))
    head.method.load_quantized(head, weight)
    assert layer.method.int8_gemm == (kernel_level in INT8_GEMM_LEVELS)
    assert not head.method.int8_gemm
    on_blocks = kernel_level in INT8_PROMPTS_ON_BLOCKS
    if layer.method.int8_gemm:  # its crossover, not the dense path's
        assert layer.method.dense_min_rows == 12
    assert (layer.method.dense_min_rows == sys.maxsize) == on_blocks
    lib = kernels.load()
    assert lib is not None
    rows = 64 if on_blocks else layer.method.dense_min_rows + 5
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    args = (x, *weight.parts(), weight.bits, weight.group)
    assert torch.equal(y, qblock.qblock_gemm(lib, *args)) == layer.method.int8_gemm
    assert torch.equal(y, qblock.qblock_matmul(lib, *args)) == on_blocks
    dense = x @ dequantize(weight, torch.float32).T
    # int8 activations: ~0.5% of the product's scale per output (per 32 or 256 values).
    torch.testing.assert_close(y, dense, rtol=0, atol=0.02 * float(dense.abs().max()))
