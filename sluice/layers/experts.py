"""The experts of a Mixture-of-Experts layer: each projection of all E experts held as
one stacked weight, run over a step's rows grouped by expert.

A GGUF stores each projection of all experts as one 3-D tensor; it stays in its block
quantization as one QuantizedTensor of E * out rows (expert e is rows e * out ..
(e + 1) * out: a view, never a copy; gate and up are interleaved per expert at load so
one matmul gives an expert's both). Dense weights (a safetensors checkpoint, or a
device without our kernels) are [E, out, in] tensors.

At a level in block_quant.PANEL_LEVELS, a stack of a model with int8 prompts is kept
in panel order (sluice/kernels/qpanel.py, where its format has one) and every row
count runs on the panel kernel, one call a step for all experts.
Otherwise, with our kernels, the experts that got fewer rows than the block kernel's crossover
(`dense_min_rows` of sluice/layers/block_quant.py) run in one grouped kernel call
(csrc/qblock.cpp's sluice_qblock_matmul_experts: activations quantized once, each
chosen expert's blocks read once for all its rows); an expert with more rows (a
prefill) runs as a dense layer does: the int8 GEMM where the model takes int8 prompts
(block_quant.int8_gemm_for), else dequantized tiles and a GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice.core.quantized_tensor import QuantizedTensor, Weight, concat_rows, dequantize
from sluice.kernels import Library, qblock, qpanel
from sluice.layers.block_quant import (
    cpu_kernels,
    dense_min_rows,
    int8_gemm_for,
    panels_for,
    quantized_linear,
)


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert: the rows each expert runs over."""

    order: torch.Tensor  # [T * k]: flat pair indices (token * k + slot), by expert, stably
    start: torch.Tensor  # [G + 1] int64, CPU: group g is sorted rows start[g] .. start[g + 1]
    expert: torch.Tensor  # [G] int64, CPU: the expert of each group (only chosen ones)
    counts: torch.Tensor  # [E] int64: rows each expert got (the routing's load)
    # (expert, first row, end row) of each group: read once, by both projections.
    spans: tuple[tuple[int, int, int], ...]
    row_expert: torch.Tensor  # [T * k]: the expert of each sorted row (for biases)

    @classmethod
    def of(cls, ids: torch.Tensor, num_experts: int) -> ExpertGroups:
        """Groups of the expert ids [T, k] a router chose."""
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        on_cpu = counts.cpu()
        expert = on_cpu.nonzero().flatten()
        start = torch.zeros(len(expert) + 1, dtype=torch.int64)
        torch.cumsum(on_cpu[expert], 0, out=start[1:])
        bounds = start.tolist()
        spans = tuple((e, bounds[g], bounds[g + 1]) for g, e in enumerate(expert.tolist()))
        return cls(order, start, expert, counts, spans, flat[order])


class Experts(nn.Module):
    """Every expert's gate/up and down projections."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden = hidden_size
        self.inter = intermediate_size
        self.gate_up_weight: Weight = torch.empty(0)
        self.down_weight: Weight = torch.empty(0)
        # gpt-oss: each expert's biases, [E, 2I] (gate, then up) and [E, H]; None: none.
        self.gate_up_bias: torch.Tensor | None = None
        self.down_bias: torch.Tensor | None = None
        self.lib: Library | None = None
        # Rows from which an expert leaves the grouped block kernel for the int8 GEMM or
        # dequantized tiles + GEMM (block_quant's crossover for each stack's format and
        # path; 0 without our kernels: always).
        self.gate_up_dense_rows = self.down_dense_rows = 0
        # Experts of many rows take the int8 GEMM (block_quant.int8_gemm_for).
        self.int8_gemm = False
        # Rows each expert has been given since load (sluice_moe_expert_tokens_total).
        self.tokens = torch.zeros(num_experts, dtype=torch.int64)

    def load(
        self,
        gate: Weight,
        up: Weight,
        down: Weight,
        *,
        dtype: torch.dtype,
        keep_quantized: bool,
        int8_prompts: bool = False,
    ) -> None:
        """The checkpoint's stacked gate, up [E, I, H] and down [E, H, I] (quantized ones
        as [E * out, in] QuantizedTensors); kept quantized where `keep_quantized` and
        every part is, else dense in `dtype`; `int8_prompts` as BlockQuantized takes it.
        Shapes are checked, naming the part."""
        e, h, i = self.num_experts, self.hidden, self.inter
        parts = (("gate", gate, (e, i, h)), ("up", up, (e, i, h)), ("down", down, (e, h, i)))
        for name, w, shape in parts:
            _check_shape(name, w, shape)
        if keep_quantized and all(isinstance(w, QuantizedTensor) for w in (gate, up, down)):
            assert isinstance(gate, QuantizedTensor) and isinstance(up, QuantizedTensor)
            assert isinstance(down, QuantizedTensor)
            both = concat_rows([gate, up])  # [gate of every expert; up of every expert]
            self.lib = cpu_kernels(torch.empty(0, dtype=dtype))
            self.int8_gemm = int8_gemm_for(self.lib, int8_prompts)
            panels = panels_for(self.lib, int8_prompts)
            self.gate_up_weight = _stored(self.lib, both.rows(_interleave(e, i)), 2 * i, panels)
            self.down_weight = _stored(self.lib, down, h, panels)
            if self.lib is not None:
                self.gate_up_dense_rows = dense_min_rows(
                    self.gate_up_weight, int8_prompts=int8_prompts
                )
                self.down_dense_rows = dense_min_rows(down, int8_prompts=int8_prompts)
            return
        # On the model's device (the checkpoint's tensors are on the CPU).
        dense = [_dense(w, shape, dtype).to(self.tokens.device) for _, w, shape in parts]
        self.gate_up_weight = torch.cat(dense[:2], dim=1).contiguous()
        self.down_weight = dense[2]

    def load_biases(self, gate: Weight, up: Weight, down: Weight, dtype: torch.dtype) -> None:
        """gpt-oss's per-expert biases: gate and up [E, I], down [E, H], in `dtype`."""
        e, h, i = self.num_experts, self.hidden, self.inter
        dense = []
        for name, b, shape in (("gate", gate, (e, i)), ("up", up, (e, i)), ("down", down, (e, h))):
            if tuple(b.shape) != shape:
                raise ValueError(
                    f"expert {name} biases have shape {tuple(b.shape)}; the model's {e} "
                    f"experts need {shape}"
                )
            value = dequantize(b, dtype) if isinstance(b, QuantizedTensor) else b.to(dtype)
            dense.append(value.to(self.tokens.device))
        self.gate_up_bias = torch.cat(dense[:2], dim=1).contiguous()
        self.down_bias = dense[2].contiguous()

    def held(self) -> list[torch.Tensor]:
        """The tensors the weights occupy (for weight_bytes)."""
        out: list[torch.Tensor] = []
        for w in (self.gate_up_weight, self.down_weight):
            out += list(w.parts()) if isinstance(w, QuantizedTensor) else [w]
        return out + [b for b in (self.gate_up_bias, self.down_bias) if b is not None]

    def gate_up(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """[rows, 2I]: each sorted row through its expert's gate and up projections."""
        self.tokens += groups.counts.to(self.tokens.device)
        y = self._run(self.gate_up_weight, x, groups, self.gate_up_dense_rows)
        return _add_bias(y, self.gate_up_bias, groups)

    def down(self, h: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """[rows, H]: each sorted row through its expert's down projection."""
        y = self._run(self.down_weight, h, groups, self.down_dense_rows)
        return _add_bias(y, self.down_bias, groups)

    def _run(
        self, w: Weight, x: torch.Tensor, groups: ExpertGroups, dense_rows: int
    ) -> torch.Tensor:
        if isinstance(w, QuantizedTensor):
            return _quantized(self.lib, w, self.num_experts, x, groups, dense_rows, self.int8_gemm)
        y = x.new_empty(x.shape[0], w.shape[1])
        for e, lo, hi in groups.spans:
            y[lo:hi] = F.linear(x[lo:hi], w[e])
        return y


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None, groups: ExpertGroups) -> torch.Tensor:
    """y's sorted rows plus their experts' biases (as the reference adds a bias after
    the product, rounded to y's dtype); y itself where there are none."""
    if bias is None:
        return y
    return y + bias[groups.row_expert.to(bias.device)]


def _stored(lib: Library | None, w: QuantizedTensor, rows: int, panels: bool) -> QuantizedTensor:
    """A stack as the experts keep it: in panel order where `panels` and its format and
    each expert's `rows` allow (csrc/qpanel.h), else as it came."""
    if lib is None or not panels or rows % qpanel.PANEL_ROWS or not qpanel.can_panel(w):
        return w
    return qpanel.to_panels(lib, w)


def _check_shape(name: str, w: Weight, shape: tuple[int, int, int]) -> None:
    e, out, k = shape
    got = w.shape
    want = (e * out, k) if isinstance(w, QuantizedTensor) else shape
    if tuple(got) != want:
        raise ValueError(
            f"expert {name} projections have shape {tuple(got)}; the model's "
            f"{e} experts of {out} x {k} need {want}"
        )


def _interleave(num_experts: int, inter: int) -> torch.Tensor:
    """Row order putting expert e's gate rows then its up rows together, from the rows
    [gate of all experts; up of all experts]."""
    e = torch.arange(num_experts)[:, None, None]
    which = torch.arange(2)[None, :, None]
    i = torch.arange(inter)[None, None, :]
    return (which * num_experts * inter + e * inter + i).flatten()


def _dense(w: Weight, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, QuantizedTensor):
        return dequantize(w, dtype).reshape(shape)
    return w.to(dtype).reshape(shape)


def _quantized(
    lib: Library | None,
    w: QuantizedTensor,
    num_experts: int,
    x: torch.Tensor,
    groups: ExpertGroups,
    few_rows: int,
    int8_gemm: bool,
) -> torch.Tensor:
    """x's sorted rows through their experts' blocks: the grouped kernel for the experts
    with fewer than `few_rows` rows; for those with more (or everywhere without our
    kernels, where few_rows is 0) the int8 GEMM where `int8_gemm`, else dequantized
    tiles and a GEMM."""
    spans = groups.spans
    if w.panels:  # every row count on the panel kernel (never without our kernels)
        assert lib is not None
        return qpanel.qpanel_experts(lib, x, w, num_experts, groups.start, groups.expert)
    if lib is not None and all(hi - lo < few_rows for _, lo, hi in spans):
        # Every chosen expert has few rows (a decode step, a few streams): one call.
        args = (w.bits, w.group, num_experts, groups.start, groups.expert)
        return qblock.qblock_matmul_experts(lib, x.contiguous(), *w.parts(), *args)
    out = w.shape[0] // num_experts
    y = x.new_empty(x.shape[0], out)
    few: list[tuple[int, int, int]] = []
    for e, lo, hi in spans:
        if hi - lo < few_rows:
            few.append((e, lo, hi))
        else:
            expert = w.row_slice(e * out, (e + 1) * out)
            y[lo:hi] = quantized_linear(lib, expert, x[lo:hi], few_rows, int8_gemm)
    if few:
        assert lib is not None
        _grouped(lib, w, num_experts, x, few, y)
    return y


def _grouped(
    lib: Library,
    w: QuantizedTensor,
    num_experts: int,
    x: torch.Tensor,
    few: list[tuple[int, int, int]],
    y: torch.Tensor,
) -> None:
    """The groups `few` (beside experts that took the GEMM) in one grouped kernel call
    over their rows, gathered, written back into their rows of y."""
    sizes = [hi - lo for _, lo, hi in few]
    start = torch.zeros(len(few) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0, out=start[1:])
    expert = torch.tensor([e for e, _, _ in few], dtype=torch.int64)
    rows = torch.cat([torch.arange(lo, hi) for _, lo, hi in few])
    y[rows] = qblock.qblock_matmul_experts(
        lib, x[rows].contiguous(), *w.parts(), w.bits, w.group, num_experts, start, expert
    )
