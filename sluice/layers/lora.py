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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice import kernels
from sluice.core.choices import LoRATarget
from sluice.core.lora import MODEL_LAYER, LoRAAdapter
from sluice.kernels import lora as lora_kernels
from sluice.kernels.lora import TILE_COLUMNS

# Up to this many rows, a mapping finds its used slots in Python (see `used`).
_FEW_ROWS = 256


class LoRAMapping:
    """A step's rows' adapter slots."""

    def __init__(self, slots: torch.Tensor, device: torch.device) -> None:
        # [rows] int32 on the CPU, -1 where a row runs the base model alone.
        self.slots = slots.to(torch.int32).contiguous()
        self.device = device
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._used: frozenset[int] | None = None

    @property
    def used(self) -> frozenset[int]:
        """The slots some row uses (made once a step)."""
        if self._used is None:
            # A decode step's few rows: a set of the list, without torch.unique's ~50 us.
            small = self.slots.numel() <= _FEW_ROWS
            slots = self.slots.tolist() if small else self.slots.unique().tolist()
            self._used = frozenset(s for s in slots if s >= 0)
        return self._used

    def mask(self, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, num_slots] on the device: 1 in each row's slot, 0 elsewhere (a row
        without an adapter is all 0). The torch path's selector; made once a step."""
        key = (num_slots, dtype)
        if key not in self._masks:
            onehot = F.one_hot(self.slots.long() + 1, num_slots + 1)[:, 1:]
            self._masks[key] = onehot.to(device=self.device, dtype=dtype)
        return self._masks[key]

    def select(self, rows: torch.Tensor | slice) -> LoRAMapping:
        """The mapping of some of the step's rows (the head's: those that sample)."""
        return LoRAMapping(self.slots[rows], self.device)


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


@dataclass(frozen=True)
class LoRAShard:
    """Which part of an adapter a tensor-parallel rank's slots hold: a column-parallel
    layer's (q/k/v, gate/up: outputs split) B rows of its output slice; a row-parallel
    layer's (o, down: inputs split) A columns of its input slice, its partial product
    summed by the layer's all-reduce like the base output. One rank holds it all."""

    rank: int = 0
    row_parallel: bool = False

    def cut(
        self, a: torch.Tensor, bt: torch.Tensor, in_features: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A [r, in] and B^T [r, out] of one projection -> this rank's (r, in_features)
        and (r, width), zero-padded where the last rank's slice is short (a vocabulary
        padded to a multiple of the ranks)."""
        if self.row_parallel:
            start = self.rank * in_features
            return _padded(a[:, start : start + in_features], in_features), bt
        start = self.rank * width
        return a, _padded(bt[:, start : start + width], width)


@dataclass(frozen=True)
class _Int8Scales:
    """int8 slots' scales, [slots, slices * rank] fp32 each: A's per row, B's per
    column (a row of B^T within a slice), and their product (u's factor)."""

    a: torch.Tensor
    b: torch.Tensor
    u: torch.Tensor

    @classmethod
    def zeros(cls, slots: int, rows: int) -> _Int8Scales:
        return cls(*(torch.zeros(slots, rows) for _ in range(3)))


class LoRASlots(nn.Module):
    """One Linear's adapter slots: A [slots, slices * rank, in] and B^T in tiles of
    columns, [slots, tiles, rank, TILE_COLUMNS] (each slice's columns cut into whole
    tiles, the last zero-padded: an expand reads a tile's rank rows as one run), zero
    where a slot (or a slice of it) holds nothing. In the compute dtype, or int8 with a
    scale per row of A and per column of B (a row of B^T within a slice); the kernels
    take their product per (slot, slice row), `u_scale`, as a factor of the shrink's
    output, and read the int8 matrices as plain numbers."""

    def __init__(
        self,
        *,
        layer: int,
        targets: tuple[LoRATarget, ...],
        widths: tuple[int, ...],
        in_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        int8: bool = False,
        shard: LoRAShard = LoRAShard(),
    ) -> None:
        """targets and widths: the projections this layer fuses, in output order, and
        how many output columns each has, on this rank (built on the default device)."""
        super().__init__()
        self.layer = layer
        self.targets = targets
        self.shard = shard
        # int8 tiles of B^T hold their rank rows in fours (the kernels' VNNI order)
        self.rank = -(-max_rank // 4) * 4 if int8 else max_rank
        self.dtype = dtype  # the activations' (and, unless int8, the matrices')
        bounds, tiles = [0], [0]  # each slice's first column, and first tile of B^T
        for w in widths:
            bounds.append(bounds[-1] + w)
            tiles.append(tiles[-1] + -(-w // TILE_COLUMNS))
        self.bounds, self.tiles = bounds, tiles
        self.offsets = torch.tensor(bounds, dtype=torch.int32, device="cpu")
        n = len(targets)
        stored = torch.int8 if int8 else dtype
        self.a: torch.Tensor
        self.bt: torch.Tensor
        a = torch.zeros(max_loras, n * self.rank, in_features, dtype=stored)
        bt = torch.zeros(max_loras, tiles[-1], self.rank, TILE_COLUMNS, dtype=stored)
        self.register_buffer("a", a, False)
        self.register_buffer("bt", bt, False)
        # Each output column's slice (the int8 torch path's per-slice steps, by column).
        self.column_slice: torch.Tensor
        slice_of = torch.arange(n).repeat_interleave(torch.tensor(widths))
        self.register_buffer("column_slice", slice_of, False)
        self.scales = _Int8Scales.zeros(max_loras, n * self.rank) if int8 else None
        # Per slot, the rank its adapter has here (0: it adapts nothing in this layer):
        # the kernels read no padding past it. On the CPU, for the kernels.
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device="cpu")
        self._adapts: list[bool] = [False] * max_loras  # ranks != 0, read without torch
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None  # the torch path's

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put this layer's part of `adapter` into `slot` (None: empty it)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.ranks[slot] = 0
        self._adapts[slot] = False
        self._dense = None
        if adapter is None:
            return
        for j, target in enumerate(self.targets):
            m = adapter.modules.get((self.layer, target))
            if m is None:
                continue
            r, first = m.a.shape[0], j * self.rank
            self.ranks[slot] = max(int(self.ranks[slot]), r)
            a, bt = self.shard.cut(
                m.a, m.b.t(), self.a.shape[2], self.bounds[j + 1] - self.bounds[j]
            )
            rows, tiles = slice(first, first + r), slice(self.tiles[j], self.tiles[j + 1])
            if self.scales is None:
                self.a[slot, rows] = a.to(self.dtype)
                self.bt[slot, tiles, :r] = _tiled(bt.to(self.dtype))
                continue
            self.a[slot, rows], self.scales.a[slot, rows] = _int8_rows(a)
            bt, self.scales.b[slot, rows] = _int8_rows(bt)
            self.bt[slot, tiles] = _in_fours(_tiled(F.pad(bt, (0, 0, 0, self.rank - r))))
        if self.scales is not None:
            self.scales.u[slot] = self.scales.a[slot] * self.scales.b[slot]
        self._adapts[slot] = bool(self.ranks[slot])

    @property
    def int8(self) -> bool:
        return self.scales is not None

    @property
    def u_scale(self) -> torch.Tensor | None:
        """What the kernels take: u's factor per (slot, slice row); None: not int8."""
        return None if self.scales is None else self.scales.u

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output for rows x) plus each row's adapter product."""
        mapping = _current
        if mapping is None or not any(self._adapts[s] for s in mapping.used):
            return y  # (the head, most adapters leave alone, skips two kernels' calls)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        lib = _kernel_lib(x2, y2, self.dtype)
        if lib is not None:
            u = lora_kernels.shrink(
                lib, x2, self.a, self.u_scale, self.rank, mapping.slots, self.ranks
            )
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
        base matmul. int8 slots: `_add_int8`."""
        if self.scales is not None:
            return self._add_int8(x, y, mapping)
        a, b = self._dense_weights(y.dtype)
        slots = self.a.shape[0]
        u = x @ a.t()  # [rows, slots * slices * rank]
        u = u.view(-1, slots, self.a.shape[1]) * mapping.mask(slots, u.dtype)[:, :, None]
        y.addmm_(u.view(u.shape[0], -1), b)

    def _add_int8(self, x: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> None:
        """add_with_torch for int8 slots, as the kernels compute it (csrc/lora.h): x's
        rows and each row's u within a slice rounded to int8 steps, the integer
        products summed in fp32 (exact below 2^24), the steps and scales applied
        after, in the kernels' order."""
        assert self.scales is not None
        a, b = self._dense_weights(torch.float32)  # the stored integers
        slots, n, rank = self.a.shape[0], len(self.targets), self.rank
        xq, x_step = _int8_steps(x.float())
        factor = x_step[:, :, None] * self.scales.u.to(x.device)  # [rows, slots, n * rank]
        u = (xq @ a.t()).view(-1, slots, n * rank) * factor
        u = u * mapping.mask(slots, u.dtype)[:, :, None]
        uq, u_step = _int8_steps(u.view(-1, slots, n, rank))  # u_step [rows, slots, n, 1]
        per_column = u_step.sum(dim=(1, 3))[:, self.column_slice]  # (one slot is nonzero)
        delta = (uq.view(uq.shape[0], -1) @ b) * per_column
        y.copy_((y.float() + delta).to(y.dtype))

    def _dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path's A [slots * slices * rank, in] and B^T with a block per
        slice [slots * slices * rank, out] (slice j's rows nonzero only in its own
        columns, so the fused layer's expand is one product), in `dtype`; int8 slots'
        as the stored integers (their scales apply to u). Made when first needed
        after a load."""
        if self._dense is None or self._dense[0].dtype != dtype:
            a, bt = self.a.to(dtype), self.bt
            n, r, slots = len(self.targets), self.rank, bt.shape[0]
            if self.scales is not None:
                bt = _in_fours(bt.flatten(0, 1), undo=True).view(bt.shape)
            bt = bt.to(dtype)
            blocks = bt.new_zeros(slots, n * r, self.bounds[-1])
            for j in range(n):
                tiles = bt[:, self.tiles[j] : self.tiles[j + 1]]  # [slots, t, rank, TILE]
                width = self.bounds[j + 1] - self.bounds[j]
                rows = tiles.permute(0, 2, 1, 3).reshape(slots, r, -1)[:, :, :width]
                blocks[:, j * r : (j + 1) * r, self.bounds[j] : self.bounds[j + 1]] = rows
            self._dense = a.flatten(0, 1), blocks.flatten(0, 1)
        return self._dense


class EmbeddingLoRASlots(nn.Module):
    """The token embedding's adapter slots: per slot A^T [vocab, rank] (a token's row
    of it is the shrink's output: the token is a one-hot row) and B^T [rank, hidden],
    in the compute dtype (a step reads one row of A^T per token). On a tensor-parallel
    rank, the rows of its vocabulary slice: a token outside it is zeroed with the
    embedding's own row, and the all-reduce sums the ranks' rows."""

    def __init__(
        self, *, vocab: int, hidden: int, max_loras: int, max_rank: int, dtype: torch.dtype,
        shard: LoRAShard = LoRAShard(row_parallel=True),
    ) -> None:  # fmt: skip
        super().__init__()
        self.shard = shard
        self.at: torch.Tensor
        self.bt: torch.Tensor
        self.register_buffer("at", torch.zeros(max_loras, vocab, max_rank, dtype=dtype), False)
        self.register_buffer("bt", torch.zeros(max_loras, max_rank, hidden, dtype=dtype), False)
        self._adapts: list[bool] = [False] * max_loras  # whether a slot's adapter has a pair

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put `adapter`'s embedding pair into `slot` (None, or none: empty it)."""
        self.at[slot].zero_()
        self.bt[slot].zero_()
        m = None if adapter is None else adapter.modules.get((MODEL_LAYER, "embed_tokens"))
        self._adapts[slot] = m is not None
        if m is None:
            return
        r = m.a.shape[0]
        a, bt = self.shard.cut(m.a, m.b.t(), self.at.shape[1], self.bt.shape[2])
        self.at[slot, :, :r] = a.t().to(self.at.dtype)
        self.bt[slot, :r] = bt.to(self.bt.dtype)

    def forward(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h (the embeddings of ids) plus each row's adapter product: its token's row
        of A^T times B^T, through the step's mapping's mask as LoRASlots' torch path."""
        mapping = _current
        if mapping is None or not any(self._adapts[s] for s in mapping.used):
            return h
        slots, rank = self.at.shape[0], self.at.shape[2]
        rows = self.at[:, ids.reshape(-1)].transpose(0, 1)  # [tokens, slots, rank]
        u = rows * mapping.mask(slots, rows.dtype)[:, :, None]
        h2 = h.view(-1, h.shape[-1])
        h2.addmm_(u.reshape(u.shape[0], slots * rank), self.bt.view(slots * rank, -1))
        return h


def _padded(w: torch.Tensor, width: int) -> torch.Tensor:
    """w [r, n <= width] with zero columns up to width."""
    return F.pad(w, (0, width - w.shape[1]))


def _tiled(bt: torch.Tensor) -> torch.Tensor:
    """A slice's B^T [rank, width] as its tiles [tiles, rank, TILE_COLUMNS], zero-padded."""
    r, width = bt.shape
    padded = F.pad(bt, (0, -width % TILE_COLUMNS))
    return padded.view(r, -1, TILE_COLUMNS).transpose(0, 1)


def _in_fours(tiles: torch.Tensor, undo: bool = False) -> torch.Tensor:
    """Tiles [tiles, rank, TILE_COLUMNS] (rank a multiple of 4) with each group of four
    rank rows stored column by column, a column's four values side by side, as the
    int8 kernels read them (csrc/lora.h's lora_itile); `undo`: back to rows."""
    t, r, c = tiles.shape
    if undo:
        return tiles.reshape(t, r // 4, c, 4).transpose(2, 3).reshape(t, r, c)
    return tiles.reshape(t, r // 4, 4, c).transpose(2, 3).reshape(t, r, c)


def _int8_steps(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v's rows (its last dimension) rounded to int8 steps of their absmax / 127, as
    whole numbers in v's dtype, and each row's step (0 for a row of zeros): a multiply
    by 127 / absmax and a round to nearest even, as the kernels' lora_quantize."""
    amax = v.abs().amax(dim=-1, keepdim=True)
    full = torch.full_like(amax, 127.0)  # tensor / tensor: IEEE division (a scalar's is
    inv = torch.where(amax > 0, full / amax, torch.zeros_like(amax))  # by its reciprocal)
    return torch.round(v * inv), amax * torch.full_like(amax, 1 / 127)


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [r, n] as int8 with one fp32 scale per row (absmax / 127, round to nearest)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return q.clamp(-127, 127).to(torch.int8), scale


def _kernel_lib(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> kernels.Library | None:
    """Our kernels where the layout allows (CPU, fp32/bf16 as the slots were made for,
    contiguous, eager)."""
    if (
        x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or not (x.dtype == y.dtype == dtype)
        or not (x.is_contiguous() and y.is_contiguous())
        or torch.compiler.is_compiling()
    ):
        return None
    return kernels.load()
