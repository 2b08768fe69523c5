"""Linear layers and the token embedding on weights kept in a GGUF file's quantization.

`quantization="gguf"` (what "auto" picks for a quantized GGUF on CPU) runs the file as
stored: each weight is a `QuantizedTensor` (sluice/core/quantized_tensor.py) and no
float copy of it exists. Two kernels serve every batch size:

* few rows (decode): the block kernel (csrc/qblock.h) reads the quantized blocks and
  multiplies them with int8-quantized activations; memory-bound, so fewer bytes win;
* many rows (prefill, many streams): the matmul is compute-bound, and a dense GEMM on
  the compute dtype beats integer dot products with per-block scales. The weight is
  dequantized a tile of rows at a time into a scratch tile that stays in cache and
  multiplied there, so the float weight never exists whole. Where the CPU has AMX
  (the `amx` level) bf16 rows take our AMX kernel instead (qblock.qblock_amx: the same
  bf16 product, a panel of 32 weight rows dequantized at a time, never written out).

The crossover (`dense_min_rows`) was measured per instruction-set level (prefill
times of the packaged models; the figures sit beside DENSE_MIN_ROWS). The output head
quantizes its activations in two int8 levels (each block, then its residual: ~15
bits), since one level flips near-tied logits; the same kernel reads the blocks, so
the vocabulary-sized head runs at the int8 kernel's bandwidth (the float-activation
kernel it replaced was compute-bound on 6-bit heads: 6.3 against 4.6 ms a token on
Qwen2.5-Coder-1.5B's). The second level is added only to the tokens that may be the
pick (`qblock.qblock_matmul_head`, bounded by each row's L2 norm, `row_norm`),
so a verifying step's positions cost one kernel row each, not two. Near the top its
logits are within 4.3e-5 (relative) of the exact ones on the packaged models
(tests/test_gguf_head.py).
Without our kernels (CUDA, or SLUICE_CPU_KERNELS=0) the same layouts run on torch ops.
"""

from __future__ import annotations

import sys
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from sluice import kernels
from sluice.core.quantized_tensor import QuantizedTensor, dequantize
from sluice.kernels import Library, qblock, qpanel
from sluice.layers.linear import Linear, LinearMethod
from sluice.layers.lora import EmbeddingLoRASlots

# Rows at or above which dequantized tiles + the dense GEMM beat the block kernel, per
# kernel level (see the module docstring). At avx2 (fp32) the block kernel is faster
# at every size measured (1.5B prefill: 506 against 886 ms at 39 tokens, 5.97 against
# 8.09 s at 512), but its int8 activations in every layer of a prefill changed the
# bundled model's answer to a plain question (tests/test_quantization.py), so prompts
# keep the unquantized GEMM. These hold for fp16 scales (Q4_0, Q4_1, Q5_x, Q8_0: four
# vector steps a 64-value pair and row), the output head's too (its two kernel rows a
# row: SmolLM2's Q8_0 head at 20 rows took 1.04x the dense path's time).
DENSE_MIN_ROWS = {"avx512": 16, "avx2": 16, "generic": 4}
# Integer scales (the K-quants: two steps a pair and row, maddubs + vpdpwssd) stay on
# the block kernel to 32 rows: on Qwen2.5-7B's layer the block kernel costs 0.60x the
# dense path at 16 rows and 0.94x at 32 (docs/results/few_rows-qwen2.5-7b.json, avx512);
# the 1.5B's and the avx2 level's crossovers measured at 32-48 rows. An output head in
# a K-quant too: its dense path dequantizes the whole vocabulary a step, so the
# two-level head kernel took 0.56-0.83x its time at 16-24 rows on OLMoE's Q6_K head
# (50304 x 2048) and 0.71-0.88x on Qwen2.5-Coder-1.5B's (151936 x 1536), 0.34-0.43x
# on the latter at avx2 (2 cores of Zen 4, ad hoc, alternating); its 16 had held
# 16-stream steps on the dense path.
DENSE_MIN_ROWS_INTEGER = {"avx512": 32, "avx2": 32, "generic": 4}
# Rows from which a weight on the int8 GEMM leaves the block kernel (in place of
# DENSE_MIN_ROWS*), every format alike: one layer's seven linears at 8/10/12/16 rows
# took 13.7/17.5/22.3/27.9 ms on the block kernel and 17.9/20.0/21.8/24.4 on the GEMM
# (Qwen2.5-7B's Q4_K/Q6_K), 2.89/3.71/4.40/5.64 against 2.64/3.07/3.07/3.68 on
# Qwen2.5-Coder-1.5B's, and Qwen2.5-Coder-0.5B's Q5_0/Q8_0 layer 1.83 against 1.27 ms
# at 12 rows (2 cores of Zen 4, benchmarks/few_rows.py, 3 rounds). Not below 12: a
# verifying step of up to 11 drafts keeps the block kernel's rows, equal to the decode
# steps it replaces.
GEMM_MIN_ROWS = {"avx512": 12}
# Levels where many rows take the int8 GEMM (csrc/qblock_gemm.h: VNNI) instead of
# dequantized tiles + torch's bf16 GEMM, for models that ask (BlockQuantized's
# int8_prompts): 0.50-0.59x the dense path's time at 32-512 rows on Qwen2.5-7B's Q4_K
# gate and Q6_K down projections (2 cores of Zen 4, ad hoc): the levels GEMM_MIN_ROWS
# names. Below them the GEMM is portable C++, for the tests (INT8_PROMPTS_ON_BLOCKS).
INT8_GEMM_LEVELS = frozenset(GEMM_MIN_ROWS)
# Rows from which a layer on the int8 GEMM takes the AMX bf16 kernel instead, at the amx
# level with bf16 activations (qblock_amx; every other many-row bf16 call takes it in
# place of dequantized tiles + torch's GEMM, which it beat at every row count from 16
# on one Qwen2.5-7B layer: docs/results/few_rows-qwen2.5-7b-amx.json). There the int8
# GEMM and the AMX kernel were even at 64 rows and the AMX kernel took 0.77x the GEMM's
# time at 128 and 0.57x at 256 (2 cores of an AMX Xeon). Its bf16 activations are the
# dense path's, finer than the GEMM's int8 ones. Below it, the int8 GEMM itself runs on
# AMX-INT8 tiles at the amx level (kernels.tiles(); csrc/qblock_gemm_amx.h, the same
# sums as VNNI's): docs/results/few_rows-qwen2.5-coder-1.5b-amx-int8.json.
AMX_AFTER_GEMM_MIN_ROWS = 128
# Levels without the int8 GEMM where a model that takes int8 prompts keeps every row
# count on the block kernel, for the formats not in panels (PANEL_LEVELS: at avx2 the
# K-quants take the panel kernel): at avx2 it beats dequantized tiles + fp32 GEMM at 16-512
# rows (Qwen2.5-1.5B's shapes at 512: Q4_K gate/up 59 against 113 ms, Q6_K down 74
# against 82, Q4_0 11 against 14; Q8_0 15 against 14; 2 cores of Zen 4 forced to avx2,
# ad hoc). An AVX2 build of the GEMM (maddubs + madd) was no faster than the block
# kernel at 512 rows (0.88-1.18x its time) and slower below, so there is none.
INT8_PROMPTS_ON_BLOCKS = frozenset({"avx2"})
# Levels where a Q4_K or Q6_K weight of a model with int8 prompts (a linear, an untied
# head, a Mixture-of-Experts stack) is kept in panel order (sluice/kernels/qpanel.py)
# and runs on the panel kernel at every row count: it does one vpdpbusd per 64
# products and row where the block kernel does two multiplies, and packs no panels a
# step as the GEMM does. A head's two-level candidates read rows rebuilt from it. Not
# the amx level, whose GEMM runs on AMX-INT8 tiles from the row-major layout (panels
# there are unmeasured). At avx2 (no VNNI) the panel kernel sums each super-block's
# group scales in int32 (maddubs, vpmaddwd) where the block kernel takes a float step
# per group and row: with it, Qwen2.5-Coder-1.5B's 512- and 16-token prompts ran
# 1.22-1.31x and 1.10-1.27x the block kernel's rate and its decode 1.01-1.10x (2 cores of
# Zen 4 forced to avx2, ad hoc, both models in one process, alternating, 5-7 rounds).
PANEL_LEVELS = frozenset({"avx512", "avx2"})
# Levels of PANEL_LEVELS where an untied output head is in panels too. Not avx2: there
# the 1.5B's decode ran 0.95-0.97x with its Q6_K head in panels (as above, twice), though
# the head alone took 5.5 / 10.7 / 39.0 / 78.2 ms at 1 / 5 / 16 / 32 rows against the
# row-major head's 5.5 / 14.9 / 45.0 / 91.8 (151936 x 1536, random, best of 5, ad hoc).
HEAD_PANEL_LEVELS = frozenset({"avx512"})
# Levels whose output head stays on its kernel at every row count. At avx2 the dense
# path dequantizes the whole vocabulary to fp32 a step and multiplies in fp32: the
# two-level head kernel took 0.24-0.56x its time at 16-128 rows on Qwen2.5-Coder-1.5B's
# Q6_K head and 0.34-0.75x on SmolLM2's Q8_0 head (2 cores of Zen 4 forced to avx2, ad
# hoc, alternating). Its two levels keep the logits near exact, so the accuracy that
# keeps prompts' other layers on the GEMM (above) does not bind it.
HEAD_ON_BLOCKS = frozenset({"avx2"})
# Rows from which the output head's first int8 level comes from the int8 GEMM on AMX-INT8
# tiles (kernels.tiles(); qblock_matmul_head's first_level "tiles"), below its dense
# crossover. On Qwen2.5-Coder-1.5B's Q6_K head (151936 x 1536) the two took 22.5 against
# 15.4 ms at 8 rows, even at 12, 25.2 against 32.5 at 14, 26.3 against 35.5 at 16 and
# 40.5 against 51.5 at 24 (2 cores of an AMX Xeon, ad hoc, alternating): a tile block
# costs the same for 1 row as for 16.
HEAD_TILES_MIN_ROWS = 13
# ... and from the VNNI int8 GEMM, at the levels that have it (INT8_GEMM_LEVELS) where
# the tiles are not held. There the head then stays on its kernel at every row count.
# On Qwen2.5-Coder-1.5B's Q6_K head (151936 x 1536) the head with that first level
# against the block kernel's took 27.0 / 25.8 ms at 12 rows, 29.0 / 32.5 at 14, 29.2 /
# 31.1 at 16 and 35.6 / 47.1 at 24, and against the dense path 52.0 / 73.2 at 32, 101 /
# 116 at 64 and 179 / 191 at 128 (2 cores of Zen 4, ad hoc, alternating).
HEAD_GEMM_MIN_ROWS = {"avx512": 14}


def head_first_level(lib: Library, rows: int) -> qblock.HeadFirstLevel:
    """Where the output head's first int8 level comes from for `rows` rows on `lib`."""
    if rows >= HEAD_TILES_MIN_ROWS and kernels.tiles(lib):
        return "tiles"
    if rows >= HEAD_GEMM_MIN_ROWS.get(kernels.variant(), sys.maxsize):
        return "gemm"
    return "blocks"


def dense_min_rows(
    weight: QuantizedTensor, output_head: bool = False, int8_prompts: bool = False
) -> int:
    """The row count from which `weight` leaves the block kernel on the active kernels.
    A layer taking `int8_prompts` (never the head) goes to the int8 GEMM from
    GEMM_MIN_ROWS where the level has it, and stays on the block kernel at an
    INT8_PROMPTS_ON_BLOCKS level; otherwise to dequantized tiles + GEMM from
    DENSE_MIN_ROWS / DENSE_MIN_ROWS_INTEGER (never for a HEAD_ON_BLOCKS head, nor for a
    head whose first level takes the VNNI GEMM: HEAD_GEMM_MIN_ROWS)."""
    level = kernels.variant()
    gemm_head = level in HEAD_GEMM_MIN_ROWS and not kernels.tiles()
    if output_head and (level in HEAD_ON_BLOCKS or gemm_head):
        return sys.maxsize
    if int8_prompts and not output_head:
        if level in INT8_GEMM_LEVELS:
            return GEMM_MIN_ROWS[level]
        if level in INT8_PROMPTS_ON_BLOCKS:
            return sys.maxsize
    table = DENSE_MIN_ROWS_INTEGER if weight.integer_scales else DENSE_MIN_ROWS
    return table.get(level, 4)


# Elements of a dequantized tile: 4M (8 MB in bf16) stays in L3 and holds every
# decoder weight of the packaged models' smaller layers in one tile.
TILE_ELEMENTS = 1 << 22


class _Scratch:
    """One reusable buffer per dtype for dequantized tiles: a fresh multi-MB tensor per
    call faulted in its pages every time (~0.1 ms a tile, half the dequantization).
    Tiles are used one at a time by the thread that runs the model."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def tile(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < rows * cols:
            buf = self.buffers[dtype] = torch.empty(max(rows * cols, TILE_ELEMENTS), dtype=dtype)
        return buf[: rows * cols].view(rows, cols)


_SCRATCH = _Scratch()


def _dequantized_rows(
    lib: Library | None, qt: QuantizedTensor, start: int, stop: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows start..stop of W as a dense [rows, K] tensor in `dtype` (in the scratch
    buffer with our kernels: valid until the next call)."""
    part = qt if (start, stop) == (0, qt.shape[0]) else qt.row_slice(start, stop)
    if lib is None:
        return dequantize(part, dtype)
    out = _SCRATCH.tile(stop - start, qt.shape[1], dtype)
    return qblock.qblock_dequantize(lib, *_kernel_args(part), dtype, out=out)


def _tile_rows(k: int) -> int:
    """Weight rows of K values a dequantized tile holds (TILE_ELEMENTS, at least 64)."""
    return max(64, TILE_ELEMENTS // k)


def row_norms(lib: Library, qt: QuantizedTensor) -> torch.Tensor:
    """[N] fp32: each row's L2 norm, summed in fp64 and rounded up (it bounds the head's
    second level), a dequantized tile of rows at a time. The tiles are fresh tensors,
    freed here (through the shared scratch, a bf16 model kept a 16 MiB fp32 tile
    resident after load that nothing else used), and small: this runs at the end of a
    load, whose peak memory they add to."""
    n, k = qt.shape
    rows = max(1, _ROW_NORM_TILE // k)
    out = torch.empty(n, dtype=torch.float32)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        tile = qblock.qblock_dequantize(
            lib, *_kernel_args(qt.row_slice(start, stop)), torch.float32
        )
        out[start:stop] = (torch.linalg.vector_norm(tile.double(), dim=1) * (1 + 1e-6)).float()
    return out


_ROW_NORM_TILE = 1 << 18  # values of a row_norms tile: 1 MiB of fp32


def _kernel_args(
    qt: QuantizedTensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    return qt.packed, qt.hbits, qt.scale, qt.minimum, qt.super_scale, qt.bits, qt.group


def cpu_kernels(weight: torch.Tensor) -> Library | None:
    """Our kernels for a layer whose compute tensor is `weight`: on CPU, in fp32 or
    bf16 (what they read and write); None means the torch-ops path."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels.load()


class BlockQuantized(LinearMethod):
    """A Linear whose weight stays in its GGUF block quantization. A weight the file
    stores as floats (or in a type we have no layout for) stays dense: this method
    then behaves as the plain one."""

    name = "gguf"

    def __init__(self, output_head: bool = False, int8_prompts: bool = False) -> None:
        self.output_head = output_head
        self.int8_prompts = int8_prompts  # as asked (EngineConfig.prompt_activations)
        # Many rows take the int8 GEMM: asked, on a level that has it, not the head.
        self.int8_gemm = False
        self.weight: QuantizedTensor | None = None
        self.lib: Library | None = None
        self.row_norm: torch.Tensor | None = None  # the output head's (row_norms)
        self.dense_min_rows = 1

    @property
    def bits(self) -> int:
        assert self.weight is not None
        return self.weight.bits

    @property
    def group(self) -> int:
        assert self.weight is not None
        return self.weight.group

    @property
    def panels(self) -> bool:
        """The weight is in panel order (sluice/kernels/qpanel.py)."""
        return self.weight is not None and self.weight.panels

    def load_quantized(self, layer: Linear, weight: QuantizedTensor, shared: bool = False) -> None:
        """`shared`: the weight is also another module's (a tied head's, the embedding's),
        which reads its rows: it stays row-major."""
        if weight.shape != (layer.out_features, layer.in_features):
            raise ValueError(
                f"shape mismatch: expected {(layer.out_features, layer.in_features)}, "
                f"got {weight.shape}"
            )
        self.lib = cpu_kernels(layer.weight)
        # The head's kernel bounds its second level per token by the row's L2 norm.
        self.row_norm = (
            row_norms(self.lib, weight) if self.output_head and self.lib is not None else None
        )
        int8_rows = self.int8_prompts and not self.output_head  # many rows: the GEMM
        # Panels where the model's linears have them: an untied head too (its first
        # level then the GEMM's sums at every row count, as from HEAD_GEMM_MIN_ROWS).
        if (
            panels_for(self.lib, self.int8_prompts, self.output_head)
            and not shared
            and qpanel.can_panel(weight)
        ):
            assert self.lib is not None
            weight = qpanel.to_panels(self.lib, weight)
        self.weight = weight
        # The kernel and the decode stack find the tensors on the layer by name.
        layer.qb_packed, layer.qb_hbits = weight.packed, weight.hbits
        layer.qb_scale, layer.qb_min = weight.scale, weight.minimum
        layer.qb_super = weight.super_scale
        layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)
        self.int8_gemm = int8_gemm_for(self.lib, int8_rows)
        # Without our kernels the dense path is the only one.
        self.dense_min_rows = (
            dense_min_rows(weight, self.output_head, self.int8_prompts) if self.lib else 1
        )

    def process_weight(self, layer: Linear) -> None:
        if self.weight is None:
            super().process_weight(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return super().apply(layer, x)
        w = self.weight
        if torch.compiler.is_compiling():  # our kernels are opaque to the compiler
            y = cast(
                torch.Tensor,
                _qblock_linear_op(
                    x,
                    *_kernel_args(w),
                    self.row_norm,
                    self.dense_min_rows,
                    self.int8_gemm,
                    w.panels,
                ),
            )
        else:
            y = _linear(self.lib, w, x, self.row_norm, self.dense_min_rows, self.int8_gemm)
        return y if layer.bias is None else y + layer.bias


def _linear(
    lib: Library | None,
    w: QuantizedTensor,
    x: torch.Tensor,
    row_norm: torch.Tensor | None,
    dense_min_rows: int,
    int8_gemm: bool = False,
) -> torch.Tensor:
    """x @ W.T: the block kernel for few rows; for many, the int8 GEMM where `int8_gemm`
    (int8_gemm_for), else dequantized tiles + the dense GEMM; at the amx level bf16
    rows take the AMX kernel in the dense path's place, and in the GEMM's from
    AMX_AFTER_GEMM_MIN_ROWS. row_norm (the output head's, row_norms) picks the head's
    kernel. A weight in panel order takes the panel kernel at every row count."""
    if w.panels:
        assert lib is not None  # panels are made only where our kernels run
        if row_norm is not None:
            return qpanel.qpanel_matmul_head(lib, x, w, row_norm)
        return qpanel.qpanel_matmul(lib, x, w)
    if lib is not None:
        args = (x.contiguous(), *_kernel_args(w))
        if x.shape[0] < dense_min_rows:
            if row_norm is not None:
                first = head_first_level(lib, x.shape[0])
                return qblock.qblock_matmul_head(lib, *args, row_norm, first_level=first)
            return qblock.qblock_matmul(lib, *args)
        if x.dtype == torch.bfloat16 and kernels.tiles(lib):
            if not int8_gemm or x.shape[0] >= AMX_AFTER_GEMM_MIN_ROWS:
                return qblock.qblock_amx(lib, *args)
        if int8_gemm:
            return qblock.qblock_gemm(lib, *args, tiles=kernels.tiles(lib))
    n, k = w.shape
    rows = _tile_rows(k)
    if rows >= n:  # the common case: one tile
        return F.linear(x, _dequantized_rows(lib, w, 0, n, x.dtype))
    y = x.new_empty(x.shape[0], n)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        y[:, start:stop] = F.linear(x, _dequantized_rows(lib, w, start, stop, x.dtype))
    return y


def quantized_linear(
    lib: Library | None,
    w: QuantizedTensor,
    x: torch.Tensor,
    dense_min_rows: int,
    int8_gemm: bool = False,
) -> torch.Tensor:
    """x @ W.T on a block-quantized weight (an expert's rows of a stacked one): the
    block kernel below `dense_min_rows` rows, from there the int8 GEMM where
    `int8_gemm`, else dequantized tiles and a GEMM."""
    return _linear(lib, w, x, None, dense_min_rows, int8_gemm)


def panels_for(lib: Library | None, int8_prompts: bool, output_head: bool = False) -> bool:
    """Whether weights that can be (linears, expert stacks, an output head) are stored in
    panel order (sluice/kernels/qpanel.py): for a model that takes int8 prompts, at a
    level in PANEL_LEVELS (a head: of HEAD_PANEL_LEVELS too); the panel kernel then runs every
    row count."""
    if not int8_prompts or lib is None:
        return False
    level = kernels.built_level(lib)
    return level in PANEL_LEVELS and (not output_head or level in HEAD_PANEL_LEVELS)


def int8_gemm_for(lib: Library | None, int8_prompts: bool) -> bool:
    """Whether many rows take the int8 GEMM: asked for (never for the output head:
    one int8 level flips its near-tied logits) and on a level in INT8_GEMM_LEVELS."""
    return int8_prompts and lib is not None and kernels.built_level(lib) in INT8_GEMM_LEVELS


@torch.library.custom_op("sluice::qblock_linear", mutates_args=())
def _qblock_linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    row_norm: torch.Tensor | None,
    dense_min_rows: int,
    int8_gemm: bool,
    panels: bool,
) -> torch.Tensor:
    w = QuantizedTensor(bits, group, packed, hbits, scale, minimum, super_scale, panels=panels)
    lib = kernels.load() if x.device.type == "cpu" else None
    return _linear(lib, w, x, row_norm, dense_min_rows, int8_gemm)


@_qblock_linear_op.register_fake
def _(
    x: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    row_norm: torch.Tensor | None,
    dense_min_rows: int,
    int8_gemm: bool,
    panels: bool,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], scale.shape[0])


class Embedding(nn.Module):
    """Token embedding whose table may stay quantized: a lookup dequantizes only the
    rows it gathers."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.quantized: QuantizedTensor | None = None
        self.lib: Library | None = None
        # Adapter slots (LoRASlotTable.attach, with LoRA enabled): each token adds its
        # request's adapter's product to its row.
        self.lora: EmbeddingLoRASlots | None = None

    def load_quantized(self, weight: QuantizedTensor) -> None:
        if weight.shape != tuple(self.weight.shape):
            raise ValueError(
                f"shape mismatch: expected {tuple(self.weight.shape)}, got {weight.shape}"
            )
        self.quantized = weight
        self.lib = cpu_kernels(self.weight)
        # Empty, but keeps the compute dtype and device that callers read off it.
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self._lookup(ids)
        return h if self.lora is None else self.lora(ids, h)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The base table's rows for ids."""
        if self.quantized is None:
            return F.embedding(ids, self.weight)
        if self.lib is not None:
            args = _kernel_args(self.quantized)
            if torch.compiler.is_compiling():  # opaque to the compiler, as above
                out = _qblock_embedding_op(ids, *args, self.weight.new_empty(0))
                return cast(torch.Tensor, out)
            return qblock.qblock_embedding(self.lib, ids, *args, self.weight.dtype)
        return dequantize(self.quantized.rows(ids), self.weight.dtype)


@torch.library.custom_op("sluice::qblock_embedding", mutates_args=())
def _qblock_embedding_op(
    ids: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    like: torch.Tensor,  # empty, of the output dtype (an op's arguments are tensors)
) -> torch.Tensor:
    lib = kernels.load()
    assert lib is not None
    args = (packed, hbits, scale, minimum, super_scale, bits, group)
    return qblock.qblock_embedding(lib, ids, *args, like.dtype)


@_qblock_embedding_op.register_fake
def _(
    ids: torch.Tensor,
    packed: torch.Tensor,
    hbits: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    super_scale: torch.Tensor,
    bits: int,
    group: int,
    like: torch.Tensor,
) -> torch.Tensor:
    return like.new_empty(ids.numel(), scale.shape[1] * group)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held (quantized blocks, dense or packed
    tensors), counting a tensor shared between modules (a tied head) once. Rotary
    tables and other caches are not weights and are left out."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        held = getattr(module, "held", None)  # a MoE layer's stacked experts
        if (
            not isinstance(module, Linear | Embedding)
            and not hasattr(module, "eps")
            and held is None
        ):
            continue  # RMSNorm has eps; rotary tables and containers are skipped
        tensors: list[torch.Tensor] = list(module.parameters(recurse=False))
        if held is not None:
            tensors += held()
        # Kernel layouts are plain tensor attributes (q4_packed, qb_scale, ...).
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        if isinstance(module, Embedding) and module.quantized is not None:
            q = module.quantized
            tensors += [q.packed, q.hbits, q.scale, q.minimum, q.super_scale]
        for t in tensors:
            # A shared weight (the tied head) is the same tensor object in both places.
            if t.numel() and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
