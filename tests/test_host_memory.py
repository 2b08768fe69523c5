"""Large model tensors live in memory advised for transparent huge pages (host_memory)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from sluice import kernels
from sluice.core import host_memory
from sluice.core.quantized_tensor import QuantizedTensor, concat_rows, pack
from sluice.layers.linear import Linear, LinearMethod
from sluice.layers.quantization import Int4WeightOnly, Int8WeightOnly
from sluice.loader import load_model

MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="needs Linux's /proc/self/smaps and MADV_HUGEPAGE",
)


def _vm_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping that holds t's first byte (smaps' two-letter codes)."""
    address = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def advised(t: torch.Tensor) -> bool:
    return "hg" in _vm_flags(t)


@pytest.mark.parametrize("shape", [(3 * MIB + 7,), (1000, 4099), (5, 2, 300, 1024)])
def test_large_tensors_are_zeroed_aligned_and_advised(shape: tuple[int, ...]) -> None:
    t = host_memory.zeroed(shape, torch.float16)
    assert t.shape == shape and t.dtype == torch.float16 and t.is_contiguous()
    assert advised(t)
    assert not t.any()
    t.fill_(1.5)  # writable, every byte
    assert float(t.float().sum()) == 1.5 * t.numel()


def test_the_partial_span_at_the_end_is_not_advised() -> None:
    """A tensor's last partial 2 MiB stays in 4 KiB pages: a huge page there would be
    resident memory beyond the tensor's bytes."""
    t = host_memory.zeroed((5 * MIB,), torch.uint8)
    whole_spans = t[: 4 * MIB]
    tail = t[4 * MIB :]
    assert advised(whole_spans)
    assert not advised(tail)


def test_small_tensors_come_from_the_allocator() -> None:
    t = host_memory.zeroed((100, 100), torch.float32)
    assert not t.any() and t.shape == (100, 100)
    assert t.untyped_storage().nbytes() == t.nbytes  # no mapping of its own
    assert host_memory.zeroed((0, 7), torch.float32).shape == (0, 7)


def test_joined_and_selected_weights_are_advised() -> None:
    """concat_rows (q, k, v into one weight) and rows (a reorder, an expert interleave)
    write into huge-page memory, and their values are the parts' own."""
    g = torch.Generator().manual_seed(0)

    def part(n: int) -> QuantizedTensor:
        u = torch.randint(0, 16, (n, 1024), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, 32, generator=g) + 0.1
        return pack(u, scale, None, 4, 32, "Q4_0")

    a, b = part(3000), part(2000)
    joined = concat_rows([a, b])
    assert advised(joined.packed)
    assert torch.equal(joined.packed, torch.cat([a.packed, b.packed]))
    order = torch.randperm(5000, generator=g)
    picked = joined.rows(order)
    assert advised(picked.packed)
    assert torch.equal(picked.packed, joined.packed[order])
    assert torch.equal(picked.scale, joined.scale[order])


def test_loaded_gguf_weights_are_advised(smollm2_path: Path) -> None:
    """The bundled model's embedding table (its one tensor over 2 MiB) as loaded."""
    table = load_model(str(smollm2_path)).tensors["model.embed_tokens.weight"]
    assert isinstance(table, QuantizedTensor) and table.packed.nbytes > 2 * MIB
    assert advised(table.packed)


@pytest.mark.parametrize("method", [Int8WeightOnly(), Int4WeightOnly()], ids=["int8", "int4"])
def test_weights_quantized_at_load_are_advised(method: LinearMethod) -> None:
    """`--quantization int8|int4` of a dense checkpoint: our kernels' packed weight."""
    if kernels.load() is None:
        pytest.skip("our CPU kernels are not built here")
    layer = Linear(4096, 1024, method=method)
    layer.weight.data.normal_()
    method.process_weight(layer)
    packed = getattr(layer, "q8_packed" if isinstance(method, Int8WeightOnly) else "q4_packed")
    assert packed.nbytes >= 2 * MIB and advised(packed)
