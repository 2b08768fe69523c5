"""Weight-only quantization methods for `Linear`, on torch's CPU kernels.

Decoding a few sequences is bound by reading weights: 4-bit weights are a quarter of
bf16's bytes. A large batch is bound by arithmetic instead, where the dense matmul is
fastest, so each method keeps the dense weight too (cheap for small models) and picks
per call by the number of rows.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import cast

import torch

from sluice import kernels
from sluice.core import host_memory
from sluice.kernels import Library, matmul
from sluice.layers.block_quant import BlockQuantized
from sluice.layers.linear import Linear, LinearMethod

# Rows at or above which the dense matmul beats the weight-only kernels on this CPU
# class. The weight-only kernels' cost grows about linearly with the rows, and the
# oneDNN-packed bf16 matmul caught up at ~4 rows for every model shape, torch's int8
# and int4 kernels and ours alike (the output head at 16 rows: int8 5.7 ms, dense 2.6).
DENSE_MIN_ROWS = 4
# fp32 activations (AVX2's auto dtype) on our SIMD kernels: the dense path is torch's
# sgemm, which at a few rows read a weight at ~7 GB/s here (8960 x 1536: 7-9 ms from 2
# to 16 rows, 2 cores of Zen 4), and the layers' int8-activation kernels stayed ahead
# to 128-256 rows (int4 at 64 rows 7.8 against 18.3 ms; at 256, 30.7 against 49.3), at
# AVX2 as at AVX-512. Prompts under 64 tokens then take int8 activations, as decoding
# does (and llama.cpp's prompts do); the bundled model's answers to plain questions
# held. The head's float kernel (49152 x 576) was ahead at 16 rows (14.4 against 18.8
# ms) and behind at 64 (63 against 35). The generic kernels keep 4.
FP32_DENSE_MIN_ROWS = 64
FP32_HEAD_DENSE_MIN_ROWS = 16


class _WeightOnly(LinearMethod, abc.ABC):
    lib: Library | None  # our kernels, set by _quantize where they run this layer

    def __init__(self, dense_min_rows: int | None = None) -> None:
        """dense_min_rows: None picks it by the weight's dtype and kernel
        (`_default_dense_min_rows`)."""
        self.dense_min_rows = DENSE_MIN_ROWS if dense_min_rows is None else dense_min_rows
        self._dense_rows_given = dense_min_rows is not None

    def process_weight(self, layer: Linear) -> None:
        dtype = layer.weight.dtype
        self._quantize(layer)
        # _quantize sets 0 for a layer that must stay dense.
        if not self._dense_rows_given and self.dense_min_rows:
            self.dense_min_rows = self._default_dense_min_rows(dtype)
        super().process_weight(layer)  # the dense copy for large batches, packed on CPU

    def _default_dense_min_rows(self, dtype: torch.dtype) -> int:
        lib = self.lib
        if dtype != torch.float32 or lib is None or kernels.built_level(lib) == "generic":
            return DENSE_MIN_ROWS
        return self._fp32_dense_min_rows()

    def _fp32_dense_min_rows(self) -> int:
        """The crossover under fp32 activations on our SIMD kernels."""
        return FP32_DENSE_MIN_ROWS

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_min_rows:
            return super().apply(layer, x)
        y = self._matmul(layer, x)
        return y if layer.bias is None else y + layer.bias

    @abc.abstractmethod
    def _quantize(self, layer: Linear) -> None:
        """Build the quantized weight from the dense one."""

    @abc.abstractmethod
    def _matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The weight-only kernel for a small batch of rows."""


class Int8WeightOnly(_WeightOnly):
    """Symmetric per-output-channel int8.

    Two kernels: ours (sluice/kernels/csrc/q8_matmul.h: int8 activations, or fp32 ones
    for the output head; VNNI, AVX2 or portable C++ by the CPU's level) where it was
    built and the input size is a multiple of 64, else torch's `_weight_int8pack_mm`.
    Either holds one copy of the int8 weight.
    """

    name = "int8"

    def __init__(
        self, dense_min_rows: int | None = None, quantize_activations: bool = True
    ) -> None:
        """quantize_activations=False multiplies unquantized activations (our
        q8_matmul_float): for the output head, whose logits pick among near-ties (the
        int8 activation blocks flipped the bundled model's first answer token on a plain
        question). torch's kernel did this before, but with fp32 activations (AVX2's
        auto dtype) it took 13-16 ms a token on the vocabulary-sized head."""
        super().__init__(dense_min_rows)
        self.quantize_activations = quantize_activations
        self.lib: Library | None = None

    def _fp32_dense_min_rows(self) -> int:
        # The head's float kernel does a float multiply-add per value: it hands over sooner.
        return FP32_DENSE_MIN_ROWS if self.quantize_activations else FP32_HEAD_DENSE_MIN_ROWS

    def _quantize(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        n, k = w.shape
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
        q = (w / scale[:, None]).round().clamp(-127, 127)
        lib = kernels.load()
        if (
            lib is not None
            and k % 64 == 0
            and layer.weight.dtype in (torch.float32, torch.bfloat16)
        ):
            self.lib = lib
            # Offset to unsigned (vpdpbusd), each pair of 32-blocks in the activations'
            # order: [b0 low 16, b1 low 16, b0 high 16, b1 high 16].
            u = (q + 128).to(torch.uint8).view(n, k // 64, 2, 2, 16).transpose(2, 3)
            layer.q8_packed = host_memory.copied(u.reshape(n, k))
            layer.q8_scale = scale.contiguous()
            return
        layer.qweight = q.to(torch.int8)
        layer.qscale = scale.to(layer.weight.dtype)

    def _matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # The quantized weights are tensors set on the module by `_quantize`; nn.Module's
        # __getattr__ types them as Tensor | Module, and custom/aten ops return Any.
        if self.lib is not None:
            packed = cast(torch.Tensor, layer.q8_packed)
            scale = cast(torch.Tensor, layer.q8_scale)
            if not self.quantize_activations:
                if torch.compiler.is_compiling():
                    return cast(torch.Tensor, _q8_matmul_float_op(x, packed, scale))
                return matmul.q8_matmul_float(self.lib, x, packed, scale)
            if torch.compiler.is_compiling():
                return cast(torch.Tensor, _q8_matmul_op(x, packed, scale))  # opaque
            return matmul.q8_matmul(self.lib, x, packed, scale)
        return cast(
            torch.Tensor, torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.qscale)
        )


class Int4WeightOnly(_WeightOnly):
    """Asymmetric int4 in groups of `group_size` along the input dimension.

    Two kernels: ours (sluice/kernels/csrc/q4_matmul.h: int8 activations, fp16 block
    scales; VNNI, AVX2 or portable C++ by the CPU's level) where it was built and the
    input size is a multiple of 64, else torch's `_weight_int4pack_mm_for_cpu` (bf16
    scales). Either holds one packed copy.
    """

    name = "int4"

    def __init__(self, group_size: int = 32, dense_min_rows: int | None = None) -> None:
        super().__init__(dense_min_rows)
        self.group_size = group_size
        self.lib: Library | None = None

    def _quantize(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        n, k = w.shape
        g = self.group_size
        lib = kernels.load()
        if lib is not None and g == 32 and k % 64 == 0:
            if layer.weight.dtype in (torch.float32, torch.bfloat16):
                self.lib = lib
        if self.lib is None and (k % g or n % 16):
            # Shapes torch's int4 packing cannot take stay dense (one method per layer).
            self.dense_min_rows = 0
            return
        groups = w.view(n, k // g, g)
        lo = groups.amin(dim=-1, keepdim=True)
        hi = groups.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp(min=1e-10)
        q = ((groups - lo) / scale).round().clamp(0, 15).to(torch.uint8)
        if self.lib is not None:
            # Byte j of a block: q[j] in the low nibble, q[j + 16] in the high one.
            layer.q4_packed = host_memory.copied(
                (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
            )
            layer.q4_scale = scale.reshape(n, k // g).to(torch.float16).contiguous()
            layer.q4_min = lo.reshape(n, k // g).to(torch.float16).contiguous()
            return
        layer.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).view(n, k), 1
        )
        # torch's kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale.
        zero = lo + 8 * scale
        sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1)  # [n, k/g, 2]
        layer.qscale_zero = sz.transpose(0, 1).contiguous().to(layer.weight.dtype)

    def _matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # As in Int8WeightOnly._matmul: tensors set by `_quantize`; ops return Any.
        if self.lib is not None:
            args = (
                x,
                cast(torch.Tensor, layer.q4_packed),
                cast(torch.Tensor, layer.q4_scale),
                cast(torch.Tensor, layer.q4_min),
            )
            if torch.compiler.is_compiling():
                return cast(torch.Tensor, _q4_matmul_op(*args))  # opaque to the compiler
            return matmul.q4_matmul(self.lib, *args)
        return cast(
            torch.Tensor,
            torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, layer.qweight, self.group_size, layer.qscale_zero
            ),
        )


def _loaded() -> Library:
    """The active kernels, for the custom ops (whose arguments can only be tensors);
    they are reached only where a method found the library at load time."""
    lib = kernels.load()
    assert lib is not None
    return lib


@torch.library.custom_op("sluice::q4_matmul", mutates_args=())
def _q4_matmul_op(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    return matmul.q4_matmul(_loaded(), x, packed, scale, minimum)


@_q4_matmul_op.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


@torch.library.custom_op("sluice::q8_matmul", mutates_args=())
def _q8_matmul_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return matmul.q8_matmul(_loaded(), x, packed, scale)


@_q8_matmul_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


@torch.library.custom_op("sluice::q8_matmul_float", mutates_args=())
def _q8_matmul_float_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return matmul.q8_matmul_float(_loaded(), x, packed, scale)


@_q8_matmul_float_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


@contextlib.contextmanager
def quantized_kernels_only(model: torch.nn.Module) -> Iterator[None]:
    """Send every batch size through the weight-only kernels (prefills included), so an
    accuracy measurement sees the weights and activations that decoding multiplies."""
    methods = [
        m.method
        for m in model.modules()
        if isinstance(m, Linear) and isinstance(m.method, _WeightOnly | BlockQuantized)
    ]
    saved = [m.dense_min_rows for m in methods]
    for m in methods:
        # 0 marks a layer that must stay dense; a BlockQuantized layer without our
        # kernels has only the dense path (1).
        if m.dense_min_rows and not (isinstance(m, BlockQuantized) and m.lib is None):
            m.dense_min_rows = 1 << 30
    try:
        yield
    finally:
        for m, rows in zip(methods, saved, strict=True):
            m.dense_min_rows = rows


def make_linear_method(
    quantization: str, output_head: bool = False, int8_prompts: bool = False
) -> LinearMethod:
    """The method for one layer. `output_head` marks the vocabulary projection: int4
    keeps it in int8, as llama.cpp's 4-bit files do (the bundled GGUF stores it as
    Q8_0). An int4 head cost 12 points of top-1 agreement with fp32 (83.8% against
    95.5%, benchmarks/quantization.py) for 0.2 ms of a 1-row step. The head also keeps
    bf16 activations (see Int8WeightOnly). `int8_prompts`: a GGUF weight's many-row
    matmuls take int8 activations (BlockQuantized)."""
    if quantization == "none":
        return LinearMethod()
    if quantization == "gguf":
        return BlockQuantized(output_head=output_head, int8_prompts=int8_prompts)
    if output_head and quantization in ("int8", "int4"):
        return Int8WeightOnly(quantize_activations=False)
    if quantization == "int8":
        return Int8WeightOnly()
    if quantization == "int4":
        return Int4WeightOnly()
    raise ValueError(f"quantization must be one of none, int8, int4, gguf; got {quantization!r}")
