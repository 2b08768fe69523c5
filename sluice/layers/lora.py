"""LoRA adapters beside a Linear: a table of slots, each holding one adapter's low-rank
pair for this layer, and the step's slot index per row.

The base matmul runs once over every row (dense or quantized, untouched); then each
row with an adapter adds its own adapter's x A^T B^T, the slot gathered per row by
our kernels (sluice/kernels/lora.py), so requests for different adapters and for the
base share one step. A fused layer (q/k/v, gate/up) has a slice per projection:
each its own A, and B's columns of that slice.

Like attention, a layer reaches the step's rows-to-slots mapping through a context
(`lora_step`), not its arguments: the model's signature stays the same with or
without adapters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sluice import kernels
from sluice.core.choices import LoRATarget
from sluice.core.lora import LoRAAdapter
from sluice.kernels import lora as lora_kernels


class LoRAMapping:
    """A step's rows' adapter slots."""

    def __init__(self, slots: torch.Tensor, device: torch.device) -> None:
        # [rows] int32 on the CPU, -1 where a row runs the base model alone.
        self.slots = slots.to(torch.int32).contiguous()
        self.device = device
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def mask(self, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, num_slots] on the device: 1 in each row's slot, 0 elsewhere (a row
        without an adapter is all 0). The torch path's selector; made once a step."""
        key = (num_slots, dtype)
        if key not in self._masks:
            onehot = F.one_hot(self.slots.long() + 1, num_slots + 1)[:, 1:]
            self._masks[key] = onehot.to(device=self.device, dtype=dtype)
        return self._masks[key]


_current: LoRAMapping | None = None


@contextlib.contextmanager
def lora_step(mapping: LoRAMapping | None) -> Iterator[None]:
    """Run the layers inside with this step's mapping (None: no row has an adapter)."""
    global _current
    previous, _current = _current, mapping
    try:
        yield
    finally:
        _current = previous


class LoRASlots(nn.Module):
    """One Linear's adapter slots: A [slots, slices * rank, in] and B^T [slots, rank,
    out] in the compute dtype, zero where a slot (or a slice of it) holds nothing."""

    def __init__(
        self,
        *,
        layer: int,
        targets: tuple[LoRATarget, ...],
        widths: tuple[int, ...],
        in_features: int,
        max_loras: int,
        max_rank: int,
    ) -> None:
        """targets and widths: the projections this layer fuses, in output order, and
        how many output columns each has (built under the model's dtype and device)."""
        super().__init__()
        self.layer = layer
        self.targets = targets
        self.rank = max_rank
        bounds = [0]
        for w in widths:
            bounds.append(bounds[-1] + w)
        self.bounds = bounds
        self.offsets = torch.tensor(bounds, dtype=torch.int32, device="cpu")
        n = len(targets)
        self.a: torch.Tensor
        self.bt: torch.Tensor
        self.register_buffer("a", torch.zeros(max_loras, n * max_rank, in_features), False)
        self.register_buffer("bt", torch.zeros(max_loras, max_rank, bounds[-1]), False)
        # Per slot, the rank its adapter has here (0: it adapts nothing in this layer):
        # the kernels read no padding past it. On the CPU, for the kernels.
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device="cpu")
        self._blocks: torch.Tensor | None = None  # the torch path's B (_b_blocks)

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put this layer's part of `adapter` into `slot` (None: empty it)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.ranks[slot] = 0
        self._blocks = None
        if adapter is None:
            return
        for j, target in enumerate(self.targets):
            m = adapter.modules.get((self.layer, target))
            if m is None:
                continue
            r, first = m.a.shape[0], j * self.rank
            self.ranks[slot] = max(int(self.ranks[slot]), r)
            self.a[slot, first : first + r] = m.a.to(self.a.dtype)
            cols = slice(self.bounds[j], self.bounds[j + 1])
            self.bt[slot, :r, cols] = m.b.t().to(self.bt.dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output for rows x) plus each row's adapter product."""
        mapping = _current
        if mapping is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        lib = _kernel_lib(x2, y2, self.a)
        if lib is not None:
            u = lora_kernels.shrink(lib, x2, self.a, self.rank, mapping.slots, self.ranks)
            lora_kernels.expand(lib, u, self.bt, self.offsets, mapping.slots, self.ranks, y2)
        else:
            self.add_with_torch(x2, y2, mapping)
        return y

    def add_with_torch(self, x: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> None:
        """y [rows, out] += each row's adapter product with torch ops (CUDA, or where
        the kernels' layout checks fail): every slot's product for every row as dense
        matrix products, each row keeping its own slot's through the mapping's mask.
        Three kernels a layer whatever the adapters, no host sync (a GPU step is
        launch-bound: a loop over slots and slices made one stream 2.6x slower); the
        extra multiplies (max_loras times the low-rank work) are small beside the
        base matmul."""
        slots = self.a.shape[0]
        u = x @ self.a.reshape(slots * self.a.shape[1], -1).t()  # [rows, slots * slices * rank]
        u = u.view(-1, slots, self.a.shape[1]) * mapping.mask(slots, u.dtype)[:, :, None]
        y.addmm_(u.view(u.shape[0], -1), self._b_blocks().flatten(0, 1))

    def _b_blocks(self) -> torch.Tensor:
        """B^T with a block per slice: [slots, slices * rank, out], slice j's rows
        nonzero only in its own columns, so the fused layer's expand is one product.
        Made from `bt` when the torch path first needs it after a load."""
        if self._blocks is None:
            n, r = len(self.targets), self.rank
            if n == 1:
                self._blocks = self.bt
            else:
                blocks = self.bt.new_zeros(self.bt.shape[0], n * r, self.bt.shape[2])
                for j in range(n):
                    cols = slice(self.bounds[j], self.bounds[j + 1])
                    blocks[:, j * r : (j + 1) * r, cols] = self.bt[:, :, cols]
                self._blocks = blocks
        return self._blocks


def _kernel_lib(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> kernels.Library | None:
    """Our kernels where the layout allows (CPU, fp32/bf16, contiguous, eager)."""
    if (
        x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or not (x.dtype == y.dtype == a.dtype)
        or not (x.is_contiguous() and y.is_contiguous())
        or torch.compiler.is_compiling()
    ):
        return None
    return kernels.load()
