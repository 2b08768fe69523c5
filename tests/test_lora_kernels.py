"""The LoRA slot layer and its shrink/expand kernels at every instruction-set level:
each row adds its own adapter's product (a fused layer's slices each their own A and
their columns of B), rows without an adapter are left as the base computed them."""

from __future__ import annotations

import pytest
import torch

from sluice import kernels
from sluice.core.lora import LoRAAdapter, LoRAModule
from sluice.kernels import lora as lora_kernels
from sluice.layers.lora import LoRAMapping, LoRASlots, lora_step

# A q/k/v layer: in 64, outputs 160 + 64 + 40 (the expand sums 64 columns at a time:
# whole tiles, a slice's partial last tile, and a slice narrower than a tile).
TARGETS = ("q_proj", "k_proj", "v_proj")
WIDTHS = (160, 64, 40)
BOUNDS = (0, 160, 224, 264)  # where each slice starts, and the end
OUT = BOUNDS[-1]
IN = 64


def _adapter(seed: int, rank: int, targets: tuple[str, ...]) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for t in targets:
        width = WIDTHS[TARGETS.index(t)]
        a = torch.randn(rank, IN, generator=g)
        b = torch.randn(width, rank, generator=g) * 0.5
        modules[(0, t)] = LoRAModule(a, b)
    return LoRAAdapter(f"a{seed}", "/x", seed, rank, modules)  # type: ignore[arg-type]


def _reference(
    x: torch.Tensor, y: torch.Tensor, adapters: list[LoRAAdapter | None], int8: bool = False
) -> tuple[torch.Tensor, float]:
    """y + each row's adapter product, in fp64 from the adapters' own matrices; `int8`:
    as int8 slots take their activations, x's row rounded to int8 steps of its absmax /
    127, and each slice's u times B's column scales (the vector that multiplies int8 B)
    rounded likewise. Also the most one rounding of that vector moves an output (0 when
    not int8): the kernels' fp32 and this fp64 can round a value near a half step to
    neighbouring steps."""
    out = y.double().clone()
    bounds = BOUNDS
    one_step = 0.0
    for t, adapter in enumerate(adapters):
        if adapter is None:
            continue
        xt = _rounded(x[t].double())[0] if int8 else x[t].double()
        for j, target in enumerate(TARGETS):
            m = adapter.modules.get((0, target))  # type: ignore[call-overload]
            if m is None:
                continue
            u, b = xt @ m.a.double().t(), m.b.double()
            if int8:
                b_scale = b.abs().amax(dim=0) / 127  # per column of B, as the slots store it
                v, step = _rounded(u * b_scale)
                u = v / b_scale
                one_step = max(one_step, step * 127)  # a step of v times |int8 B| <= 127
            out[t, bounds[j] : bounds[j + 1]] += u @ b.t()
    return out, one_step


def _rounded(v: torch.Tensor) -> tuple[torch.Tensor, float]:
    """v rounded to int8 steps of its absmax / 127, and the step."""
    step = v.abs().max() / 127
    return (torch.round(v / step) * step if step > 0 else v), step.item()


def _slots(dtype: torch.dtype, max_rank: int = 16, int8: bool = False) -> LoRASlots:
    return LoRASlots(
        layer=0,
        targets=TARGETS,
        widths=WIDTHS,
        in_features=IN,
        max_loras=3,
        max_rank=max_rank,
        dtype=dtype,
        int8=int8,
    )


def _as_stored(adapter: LoRAAdapter) -> LoRAAdapter:
    """The adapter as int8 slots hold it: each A row and B column rounded to int8
    steps of its own absmax / 127."""

    def rounded(w: torch.Tensor) -> torch.Tensor:
        step = w.abs().amax(dim=1, keepdim=True) / 127
        return torch.round(w / step) * step

    modules = {k: LoRAModule(rounded(m.a), rounded(m.b.t()).t())
               for k, m in adapter.modules.items()}  # fmt: skip
    return LoRAAdapter(adapter.name, "/x", adapter.key, adapter.rank, modules)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "int8"),
    [(dtype, int8) for int8 in (False, True) for dtype in (torch.float32, torch.bfloat16)],
)
def test_each_row_adds_its_own_adapter(kernel_level: str, dtype: torch.dtype, int8: bool) -> None:
    """Each row gets its own slot's product; int8 slots compute exactly what their
    rounded matrices give (fp32), within int8's rounding of the adapter itself."""
    assert kernels.variant() == kernel_level
    layer = _slots(dtype, int8=int8)
    ad = [
        _adapter(1, 8, TARGETS),
        _adapter(2, 16, ("q_proj", "v_proj")),
        _adapter(3, 4, ("k_proj",)),
    ]
    for slot, a in enumerate(ad):
        layer.load(slot, a)
    rows = [0, None, 1, 2, 0, None, 2, 1, 1]  # adapter index per row, None: the base
    x = torch.randn(len(rows), IN).to(dtype)
    y = torch.randn(len(rows), OUT).to(dtype)
    slots = torch.tensor([-1 if r is None else r for r in rows], dtype=torch.int32)
    stored = [_as_stored(a) for a in ad] if int8 else ad
    want, one_step = _reference(x, y, [None if r is None else stored[r] for r in rows], int8)
    with lora_step(LoRAMapping(slots, torch.device("cpu"))):
        got = layer(x, y.clone())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= tol * scale + one_step
    if int8:  # and the rounding itself is small beside the product
        exact, _ = _reference(x, y, [None if r is None else ad[r] for r in rows])
        assert (got.double() - exact).abs().max().item() <= 3e-2 * scale
    base_rows = [i for i, r in enumerate(rows) if r is None]
    assert torch.equal(got[base_rows], y[base_rows])  # untouched, bit for bit


@pytest.mark.parametrize("int8", [False, True])
def test_torch_path_matches_kernels(kernel_level: str, int8: bool) -> None:
    """The path off CPU (every slot's product, masked per row) gives what the kernels
    give at every level, also after a slot is loaded again: int8 slots bit for bit
    (integer sums, the same roundings and fp32 products in the same order)."""
    assert kernels.variant() == kernel_level
    layer = _slots(torch.float32, int8=int8)
    ad = [_adapter(4, 8, TARGETS), _adapter(5, 12, TARGETS)]
    for slot, a in enumerate(ad):
        layer.load(slot, a)
    x, y = torch.randn(5, IN), torch.randn(5, OUT)
    slots = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32)
    mapping = LoRAMapping(slots, torch.device("cpu"))
    # fp slots: two fp32 sums of the same products in different orders, a few units in
    # the last place of the largest partial sums (the products reach ~64, where one is
    # 7.6e-6).
    close = {"rtol": 0.0, "atol": 0.0} if int8 else {"rtol": 1e-5, "atol": 4e-5}
    with lora_step(mapping):
        fast = layer(x, y.clone())
    slow = y.clone()
    layer.add_with_torch(x, slow, mapping)
    torch.testing.assert_close(fast, slow, **close)
    layer.load(0, _adapter(9, 16, ("k_proj", "v_proj")))  # a new adapter in slot 0
    with lora_step(mapping):
        fast = layer(x, y.clone())
    slow = y.clone()
    layer.add_with_torch(x, slow, mapping)
    torch.testing.assert_close(fast, slow, **close)


def test_reloading_a_slot_replaces_every_slice() -> None:
    """A slot taken by an adapter that adapts fewer projections holds nothing of the
    one before it."""
    layer = _slots(torch.float32)
    layer.load(0, _adapter(6, 16, TARGETS))
    smaller = _adapter(7, 4, ("k_proj",))
    layer.load(0, smaller)
    x, y = torch.randn(3, IN), torch.zeros(3, OUT)
    slots = torch.zeros(3, dtype=torch.int32)
    with lora_step(LoRAMapping(slots, torch.device("cpu"))):
        got = layer(x, y.clone())
    want, _ = _reference(x, y, [smaller] * 3)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert got[:, :160].abs().max() == 0 and got[:, 224:].abs().max() == 0


def test_no_mapping_leaves_the_output_alone() -> None:
    layer = _slots(torch.float32)
    layer.load(0, _adapter(8, 8, TARGETS))
    y = torch.randn(2, OUT)
    assert layer(torch.randn(2, IN), y) is y


def test_tile_width_matches_the_library() -> None:
    """The slots are laid out in the tiles the compiled expand reads."""
    lib = kernels.load()
    if lib is None:
        pytest.skip("no kernels")
    assert lora_kernels.tile_columns(lib) == lora_kernels.TILE_COLUMNS


@pytest.mark.parametrize("rows", [1, 5, 256, 257, 4096])
def test_mapping_used_slots(rows: int) -> None:
    """The slots a step's rows use, whichever way (Python or torch.unique) the
    mapping finds them for its number of rows; -1 (no adapter) is not a slot."""
    slots = torch.full((rows,), -1, dtype=torch.int32)
    slots[-1] = 0
    slots[rows // 2] = 3
    want = {3} if rows == 1 else {0, 3}
    assert LoRAMapping(slots, torch.device("cpu")).used == want
    assert LoRAMapping(torch.full((rows,), -1), torch.device("cpu")).used == frozenset()
