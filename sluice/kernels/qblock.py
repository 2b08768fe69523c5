"""Bindings of the qblock kernels (csrc/qblock.cpp): GGUF block-quantized weights kept
quantized in memory, in the three layouts of issue 13 (restated in csrc/qblock.h).

A weight is (packed, hbits, scale, minimum, super_scale, bits, group): W[n, k] =
scale[n, k // group] * u[n, k] + minimum[n, k // group], u of `bits` bits (4, 5, 6 or
8; or E2M1: MXFP4's 4-bit codes, u looked up from them) in pair-permuted order;
`hbits` holds the bits above the fourth and is an empty uint8 tensor unless bits is 5
or 6; `minimum` is empty for a symmetric weight (minimum
= -2**(bits - 1) * scale). Scales are float16, or int8 times the float16 multipliers
`super_scale` [N, 1 or 2, K / 256] (empty for float16 scales). Rows are independent,
so row slices of the five tensors are weights too (sluice/core/quantized_tensor.py).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from sluice.core.quantized_tensor import E2M1, INTEGER_SCALE_LAYOUTS, SUPER
from sluice.kernels._ffi import (
    INT,
    INT64,
    POINTER,
    CFunction,
    Library,
    c_function,
    is_bf16,
    ptr,
)

# The formats the kernels take: (bits, group); with integer scales, INTEGER_SCALE_LAYOUTS.
FORMATS = frozenset({(b, g) for b in (4, 5, 6, 8) for g in (32, 16)} | {(E2M1, 32)})
# Where the output head's first int8 level comes from: the block kernel, the int8 GEMM,
# or that GEMM on AMX-INT8 tiles; in the order of csrc/qblock.cpp's HeadFirstLevel.
HeadFirstLevel = Literal["blocks", "gemm", "tiles"]
HEAD_FIRST_LEVELS: tuple[HeadFirstLevel, ...] = get_args(HeadFirstLevel)
# ... and the code after them: the panel kernel on a weight in panel order, which only
# qpanel.qpanel_matmul_head passes (it checks the weight is one).
HEAD_FIRST_PANELS = len(HEAD_FIRST_LEVELS)

_ROW_BLOCK = c_function("sluice_qblock_row_block", INT)
# (x, bf16, M, K, bits, group, packed, hbits, d, m, s, N, y)
_MATMUL_ARGS = (
    *(POINTER, INT, INT, INT, INT, INT),
    *(POINTER, POINTER, POINTER, POINTER, POINTER, INT, POINTER),
)
_MATMUL = c_function("sluice_qblock_matmul", None, *_MATMUL_ARGS)
_MATMUL_FLOAT = c_function("sluice_qblock_matmul_float", None, *_MATMUL_ARGS)
_MATMUL_RESIDUAL = c_function("sluice_qblock_matmul_residual", None, *_MATMUL_ARGS)
# (x, bf16, M, K, bits, group, packed, hbits, d, m, s, N, tiles, y)
_GEMM = c_function("sluice_qblock_gemm", None, *_MATMUL_ARGS[:-1], INT, POINTER)
_AMX_INT8_CALLS = c_function("sluice_amx_int8_calls", INT64)
_AMX = c_function("sluice_qblock_amx", INT, *_MATMUL_ARGS)
_HAS_AMX = c_function("sluice_amx", INT)
_AMX_CALLS = c_function("sluice_amx_calls", INT64)
# (x, bf16, M, K, bits, group, packed, hbits, d, m, s, N, row_norm, tiles, y)
_MATMUL_HEAD = c_function(
    "sluice_qblock_matmul_head", None, *_MATMUL_ARGS[:-1], POINTER, INT, POINTER
)
# (x, bf16, M, K, bits, group, packed, hbits, d, m, s, N, num_groups, group_start,
#  group_expert, y)
_MATMUL_EXPERTS = c_function(
    "sluice_qblock_matmul_experts", None, *_MATMUL_ARGS[:-1], INT, POINTER, POINTER, POINTER
)
# (bits, group, packed, hbits, d, m, s, K, N, out, out_bf16)
_DEQUANTIZE = c_function(
    "sluice_qblock_dequantize",
    None,
    *(INT, INT, POINTER, POINTER, POINTER, POINTER, POINTER, INT, INT, POINTER, INT),
)
# (ids, T, bits, group, packed, hbits, d, m, s, K, out, out_bf16)
_EMBEDDING = c_function(
    "sluice_qblock_embedding",
    None,
    *(POINTER, INT, INT, INT, POINTER, POINTER, POINTER, POINTER, POINTER, INT, POINTER, INT),
)


def row_block(lib: Library) -> int:
    """Activation rows the int8-activation matmul serves with one read of each weight
    (12 at AVX-512, 4 below): up to this many rows cost one pass over the weights."""
    return int(_ROW_BLOCK(lib))


def _check_scales(
    n: int,
    k: int,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
) -> None:
    """Raise unless the scales fit the layout: float16, or int8 with multipliers."""
    symmetric = minimum.numel() == 0
    if tuple(scale.shape) != (n, k // group) or not (symmetric or scale.shape == minimum.shape):
        raise ValueError(
            f"qblock weight shapes: {n} rows of {k}, scale {tuple(scale.shape)}, "
            f"minimum {tuple(minimum.shape)}"
        )
    integer = super_scale.numel() > 0
    want = torch.int8 if integer else torch.float16
    if scale.dtype != want or (minimum.numel() and minimum.dtype != want):
        raise ValueError(f"qblock scales and minimums must be {want} here, got {scale.dtype}")
    if not integer:
        return
    if (bits, group) not in INTEGER_SCALE_LAYOUTS or k % SUPER:
        raise ValueError(f"no qblock kernel for integer scales at {bits}/{group}, K = {k}")
    shape = (n, 1 if symmetric else 2, k // SUPER)
    if tuple(super_scale.shape) != shape or super_scale.dtype != torch.float16:
        raise ValueError(f"super_scale must be float16 {list(shape)}")


def weight_args(
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
) -> tuple[int, int, tuple[int, int, int, int, int]]:
    """(N, K, the five pointers) after checking the weight's layout."""
    if (bits, group) not in FORMATS:
        raise ValueError(f"no qblock kernel for {bits} bits in groups of {group}")
    if packed.dtype != torch.uint8:
        raise ValueError("qblock values are uint8")
    n = packed.shape[0]
    k = packed.shape[1] * (1 if bits == 8 else 2)
    if k % 64:
        raise ValueError(f"qblock rows of {k} values: not a multiple of 64")
    _check_scales(n, k, scale, minimum, super_scale, bits, group)
    hcols = {5: k // 8, 6: k // 4}.get(bits, 0)
    tensors = [t for t in (packed, scale, minimum, super_scale) if t.numel()]
    if not all(t.is_contiguous() for t in tensors + ([hbits] if hcols else [])):
        raise ValueError("qblock weight tensors must be contiguous (row slices are)")
    if hcols and (tuple(hbits.shape) != (n, hcols) or hbits.dtype != torch.uint8):
        raise ValueError(f"{bits}-bit hbits must be uint8 [{n}, {hcols}]")

    def p(t: torch.Tensor) -> int:
        return ptr(t) if t.numel() else 0

    return n, k, (ptr(packed), p(hbits) if hcols else 0, ptr(scale), p(minimum), p(super_scale))


def activations(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as the matmuls take it: contiguous fp32 or bf16 [M, K]."""
    x = x.contiguous()
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be fp32 or bf16 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    return x


def run_matmul(
    fn: CFunction,
    lib: Library,
    x: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    extra: tuple[int, ...] = (),
) -> torch.Tensor:
    """y = fn(x, the weight) for a matmul entry point (x, bf16, M, K, bits, group, the
    weight's five pointers, N, extra..., y): extra, what fn takes between N and y."""
    n, k, weight = weight_args(packed, hbits, scale, minimum, super_scale, bits, group)
    x = activations(x, k)
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        fn(lib, ptr(x), is_bf16(x), m, k, bits, group, *weight, n, *extra, ptr(y))
    return y


def qblock_matmul(
    lib: Library,
    x: torch.Tensor,  # [M, K] fp32 or bf16
    packed: torch.Tensor,  # [N, K / 2] (4-6 bits) or [N, K] (8 bits) uint8
    hbits: torch.Tensor,  # [N, K / 8] (5 bits), [N, K / 4] (6 bits) uint8, else empty
    scale: torch.Tensor,  # [N, K / group] fp16 (or int8 with super_scale)
    minimum: torch.Tensor,  # [N, K / group] as scale, empty when symmetric
    super_scale: torch.Tensor,  # [N, 1 or 2, K / 256] fp16, empty for fp16 scales
    bits: int,
    group: int,
) -> torch.Tensor:
    """y [M, N] = x @ W.T in x's dtype, x quantized to int8 per block of 32 (of 256
    values, the super-block, for integer scales: their products then sum in int32)."""
    return run_matmul(_MATMUL, lib, x, packed, hbits, scale, minimum, super_scale, bits, group)


def qblock_gemm(
    lib: Library,
    x: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    tiles: bool = False,
) -> torch.Tensor:
    """qblock_matmul's product for many rows (prompts, many streams): the same int8
    activations, multiplied by the weight unpacked 32 rows at a time into the order the
    integer dot-product instructions take, each panel reused by every row
    (csrc/qblock_gemm.h). Not bit-equal to qblock_matmul: it sums in another order.
    `tiles`: on AMX-INT8 tiles where has_amx(lib) (csrc/qblock_gemm_amx.h; bit-equal to
    the VNNI path); only where the process holds the tile state (kernels.tiles())."""
    args = (packed, hbits, scale, minimum, super_scale, bits, group)
    return run_matmul(_GEMM, lib, x, *args, extra=(int(tiles),))


def qblock_amx(
    lib: Library,
    x: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
) -> torch.Tensor:
    """y [M, N] = x @ W.T for bf16 x on AMX tiles: what the dense path computes (the
    weight dequantized to bf16, fp32 sums), the weight dequantized a panel of 32 rows
    at a time in the tiles' order and never written out (csrc/qblock_amx.h). Only
    where has_amx(lib) and the process holds the tile state (sluice.kernels.tiles())."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"qblock_amx takes bf16 activations, got {x.dtype}")
    n, k, weight = weight_args(packed, hbits, scale, minimum, super_scale, bits, group)
    x = activations(x, k)
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    if x.shape[0] and _AMX(lib, ptr(x), 1, x.shape[0], k, bits, group, *weight, n, ptr(y)):
        raise RuntimeError("this kernel library has no AMX path (sluice_amx() is 0)")
    return y


def has_amx(lib: Library) -> bool:
    """Whether `lib` has qblock_amx's tile path (the avx512 build)."""
    return bool(_HAS_AMX(lib))


def amx_calls(lib: Library) -> int:
    """Threads' shares of qblock_amx calls that ran on the tiles so far."""
    return int(_AMX_CALLS(lib))


def amx_int8_calls(lib: Library) -> int:
    """Threads' shares of qblock_gemm calls that ran on the int8 tiles so far."""
    return int(_AMX_INT8_CALLS(lib))


def qblock_matmul_float(
    lib: Library,
    x: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
) -> torch.Tensor:
    """qblock_matmul with unquantized activations (fp32 accumulation): exact, the
    reference qblock_matmul_residual (the output head) is checked against."""
    return run_matmul(
        _MATMUL_FLOAT, lib, x, packed, hbits, scale, minimum, super_scale, bits, group
    )


def qblock_matmul_residual(
    lib: Library,
    x: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
) -> torch.Tensor:
    """qblock_matmul with x quantized in two int8 levels: each block (as qblock_matmul
    makes them), then what that leaves out (x - dx * q) in blocks of its own, so every
    value is kept to within 1/508 of its block's step (~15 bits of the block's largest),
    at the int8 kernel's speed: the output head."""
    return run_matmul(
        _MATMUL_RESIDUAL, lib, x, packed, hbits, scale, minimum, super_scale, bits, group
    )


def qblock_matmul_head(
    lib: Library,
    x: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    row_norm: torch.Tensor,  # [N] fp32: each weight row's L2 norm, rounded up
    first_level: HeadFirstLevel = "blocks",
) -> torch.Tensor:
    """The output head: qblock_matmul_residual's value, bit for bit, for every token
    whose logit may be the row's largest (its one-level value plus the bound
    row_norm[n] * |residual| reaches the best lower bound of any token), and for the rest
    qblock_matmul's. Greedy picks and the logits near the top are those of the two
    levels; the second level costs a dot product per such token instead of a second
    kernel row per position. `first_level`: where the one level comes from
    (HEAD_FIRST_LEVELS: the block kernel, qblock_gemm, or qblock_gemm on AMX-INT8 tiles
    where has_amx(lib) and the process holds the tile state); the rest take its values,
    the candidates are the same either way."""
    weight = (packed, hbits, scale, minimum, super_scale, bits, group)
    if first_level not in HEAD_FIRST_LEVELS:
        raise ValueError(f"first_level must be one of {HEAD_FIRST_LEVELS}, got {first_level!r}")
    return run_head(lib, x, weight, row_norm, HEAD_FIRST_LEVELS.index(first_level))


def run_head(
    lib: Library,
    x: torch.Tensor,
    weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int],
    row_norm: torch.Tensor,
    first: int,
) -> torch.Tensor:
    """The head kernel on `weight` (its five tensors, bits, group) with its first level
    from `first` (csrc/qblock.cpp's HeadFirstLevel: an index of HEAD_FIRST_LEVELS, or
    HEAD_FIRST_PANELS)."""
    n = weight[0].shape[0]
    if row_norm.shape != (n,) or row_norm.dtype != torch.float32 or not row_norm.is_contiguous():
        raise ValueError(f"row_norm must be contiguous float32 [{n}]")
    return run_matmul(_MATMUL_HEAD, lib, x, *weight, extra=(ptr(row_norm), first))


def check_expert_groups(
    group_start: torch.Tensor, group_expert: torch.Tensor, m: int, num_experts: int
) -> None:
    """Raise unless group_start holds len(group_expert) + 1 row bounds rising from 0 to
    M and every group_expert names an expert (both contiguous int64 on the CPU)."""
    for name, t in (("group_start", group_start), ("group_expert", group_expert)):
        if (t.dtype, t.dim(), t.device.type) != (torch.int64, 1, "cpu") or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int64 CPU tensor")
    if group_start.numel() != group_expert.numel() + 1:
        raise ValueError(
            f"group_start has {group_start.numel()} bounds for {group_expert.numel()} groups "
            "(one more than the groups)"
        )
    bounds = group_start.tolist()  # (a handful of values a step: cheaper than torch ops)
    if bounds[0] != 0 or bounds[-1] != m or bounds != sorted(bounds):
        raise ValueError(f"group_start must rise from 0 to M = {m}, got {bounds}")
    experts = group_expert.tolist()
    if experts and not (0 <= min(experts) and max(experts) < num_experts):
        raise ValueError(f"group_expert ids must lie in [0, {num_experts}), got {experts}")


def qblock_matmul_experts(
    lib: Library,
    x: torch.Tensor,  # [M, K] fp32 or bf16: the (token, expert) pairs' rows, by group
    packed: torch.Tensor,  # the five tensors of E experts' weights stacked: [E * N, ...]
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    num_experts: int,
    group_start: torch.Tensor,  # [G + 1] int64: group j is rows group_start[j] .. [j + 1]
    group_expert: torch.Tensor,  # [G] int64: group j's expert
) -> torch.Tensor:
    """y [M, N] (x's dtype, N = rows / num_experts): each group's rows @ W_e.T, W_e =
    rows e * N .. (e + 1) * N of the stacked weight (a Mixture-of-Experts layer's
    projection), every row as qblock_matmul computes it. One call for all groups: the
    activations are quantized once, and only the named experts' weights are read."""
    rows, k, weight = weight_args(packed, hbits, scale, minimum, super_scale, bits, group)
    groups = (num_experts, group_start, group_expert)
    return run_experts(_MATMUL_EXPERTS, lib, x, rows, k, weight, bits, group, *groups)


def run_experts(
    fn: CFunction,
    lib: Library,
    x: torch.Tensor,
    rows: int,
    k: int,
    weight: tuple[int, int, int, int, int],
    bits: int,
    group: int,
    num_experts: int,
    group_start: torch.Tensor,
    group_expert: torch.Tensor,
) -> torch.Tensor:
    """y [M, N] from a grouped experts kernel `fn` (x, bf16, M, K, bits, group, the
    weight's five pointers, N, groups, group_start, group_expert, y) on E experts
    stacked in `rows` weight rows of K, x and the groups checked first."""
    if num_experts < 1 or rows % num_experts:
        raise ValueError(f"{rows} weight rows do not split into {num_experts} experts")
    n = rows // num_experts
    x = activations(x, k)
    m = x.shape[0]
    check_expert_groups(group_start, group_expert, m, num_experts)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        fn(
            lib,
            *(ptr(x), is_bf16(x), m, k, bits, group, *weight, n),
            *(group_expert.numel(), ptr(group_start), ptr(group_expert), ptr(y)),
        )
    return y


def _out_dtype(dtype: torch.dtype) -> int:
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"qblock dequantizes to float32 or bfloat16, not {dtype}")
    return int(dtype == torch.bfloat16)


def qblock_dequantize(
    lib: Library,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """W [N, K] in natural order, in `dtype` (float32 or bfloat16); into `out` (a
    contiguous [N, K] tensor of that dtype) when given, so a caller can reuse one
    scratch buffer instead of faulting in fresh pages on every call."""
    n, k, weight = weight_args(packed, hbits, scale, minimum, super_scale, bits, group)
    if out is None:
        out = torch.empty(n, k, dtype=dtype)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} [{n}, {k}] tensor")
    _DEQUANTIZE(lib, bits, group, *weight, k, n, ptr(out), _out_dtype(dtype))
    return out


def qblock_embedding(
    lib: Library,
    ids: torch.Tensor,  # [T] integer row indices
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W[ids] [T, K] in `dtype` (a token embedding lookup)."""
    n, k, weight = weight_args(packed, hbits, scale, minimum, super_scale, bits, group)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < n):
        raise IndexError(f"qblock embedding ids out of range [0, {n})")
    out = torch.empty(ids.numel(), k, dtype=dtype)
    _EMBEDDING(lib, ptr(ids), ids.numel(), bits, group, *weight, k, ptr(out), _out_dtype(dtype))
    return out
