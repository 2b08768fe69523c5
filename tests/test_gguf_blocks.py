"""GGUF block formats kept quantized: every decoder against gguf's own dequantization,
the layouts' packing, and the loader's output on the bundled model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from sluice import settings
from sluice.core.quantized_tensor import (
    QuantizedTensor,
    concat_rows,
    dequantize,
    pack,
    unpack_values,
)
from sluice.kernels import repack as repack_kernel
from sluice.loader import load_model
from sluice.loader.gguf_blocks import FORMATS, repack

# Byte offsets of each block's float16 scale fields (set to sane values in random
# blocks: random bytes there could be inf/NaN or overflow the products).
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "MXFP4": (),
}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid blocks: every bit pattern of the values and sub-scales is a
    legal block; the float16 fields get small random magnitudes of both signs."""
    per_block, nbytes = FORMATS[type_name][:2]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
    for start in _F16_FIELDS[type_name]:
        scale = rng.uniform(-0.02, 0.02, size=blocks.shape[0]).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8).reshape(-1, 2)
    if type_name == "MXFP4":  # E8M0 scales 2**-24 .. 2**15: float16's subnormals and normals
        blocks[:, 0] = rng.integers(104, 144, size=blocks.shape[0], dtype=np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_every_format_decodes_as_gguf_does(type_name: str) -> None:
    rows, cols = 6, 512
    raw = random_blocks(type_name, rows, cols)
    expected = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    qt = repack(torch.from_numpy(raw), type_name, rows, cols)
    assert (qt.bits, qt.group) == FORMATS[type_name][3:]
    got = dequantize(qt).numpy()
    # Legacy formats are exact. K-quant scales are products of a float16 and an
    # integer, kept as such (integer scales): exact too, where gguf's reference rounds
    # each product in float32 (a few ulps).
    tol = 0.0 if "K" not in type_name else 2.0**-21 * np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=tol)
    assert qt.integer_scales == ("K" in type_name)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_the_c_repack_writes_the_torch_paths_bytes(
    type_name: str, monkeypatch: pytest.MonkeyPatch, kernel_level: str
) -> None:
    """The kernels' repack (csrc/gguf_repack.cpp: what a load runs where they build, in
    each level's build) writes every part of the layout exactly as the torch path
    does, the one checked against gguf's own decoding above."""
    from sluice import kernels
    from sluice.loader import gguf_blocks

    assert kernels.load() is not None and type_name in repack_kernel.FORMAT_CODES
    rows, cols = 37, 768  # three 256-value super-blocks a row
    raw = torch.from_numpy(random_blocks(type_name, rows, cols, seed=3))
    monkeypatch.setattr(gguf_blocks, "C_CHUNK_VALUES", 16 * cols)  # chunks 16, 16, 5 rows
    got = repack(raw, type_name, rows, cols)
    monkeypatch.setattr(gguf_blocks.kernels, "load", lambda: None)
    want = repack(raw, type_name, rows, cols)
    for name in ("packed", "hbits", "scale", "minimum", "super_scale"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert (got.bits, got.group, got.source) == (want.bits, want.group, want.source)


@pytest.mark.parametrize("c_repack", [True, False])
def test_an_mxfp4_scale_beyond_float16_is_refused(
    c_repack: bool, monkeypatch: pytest.MonkeyPatch, kernel_level: str
) -> None:
    """An E8M0 exponent byte of 144 (2**16 with the doubled values) has no float16
    scale: both repack paths refuse it by format, not store an infinity."""
    from sluice.loader import gguf_blocks

    raw = random_blocks("MXFP4", 2, 64)
    raw[1, 17] = 144  # the second row's first block
    if not c_repack:
        monkeypatch.setattr(gguf_blocks.kernels, "load", lambda: None)
    with pytest.raises(ValueError, match="MXFP4 block scale"):
        repack(torch.from_numpy(raw), "MXFP4", 2, 64)


def test_the_c_repack_refuses_rows_of_the_wrong_size(kernel_level: str) -> None:
    # It reads exactly a row's blocks: a short read (a file whose tensor table lies)
    # is refused, not read past.
    def short(r0: int, r1: int) -> torch.Tensor:
        return torch.zeros((r1 - r0) * 144 - 1, dtype=torch.uint8)

    with pytest.raises(ValueError, match="144 bytes"):
        repack(short, "Q4_K", 2, 256)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits,group", [(b, g) for b in (4, 5, 6, 8) for g in (32, 16)])
def test_pack_round_trips_and_widening_is_exact(bits: int, group: int, symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(bits * group)
    u = torch.randint(0, 1 << bits, (5, 192), generator=gen, dtype=torch.uint8)
    scale = torch.rand(5, 192 // group, generator=gen)
    minimum = None if symmetric else torch.randn(5, 192 // group, generator=gen)
    qt = pack(u, scale, minimum, bits, group)
    assert torch.equal(unpack_values(qt), u)
    assert qt.symmetric == symmetric
    w = dequantize(qt)
    if symmetric:  # the implied offset
        expected = (u.float() - 2 ** (bits - 1)).view(5, -1, group) * qt.scale.float()[..., None]
        assert torch.equal(w, expected.view(5, 192))
    for wider_bits in (6, 8):
        if wider_bits >= bits:
            wide = qt.widened(wider_bits, 16)
            assert torch.equal(dequantize(wide), w)
            assert wide.symmetric == (symmetric and (wider_bits, 16) == (bits, group))
    # Pair positions: b0[0:16], b1[0:16], b0[16:32], b1[16:32] (bits 8 shows it plainly).
    if bits == 8:
        order = torch.cat([u[0, 0:16], u[0, 32:48], u[0, 16:32], u[0, 48:64]])
        assert torch.equal(qt.packed[0, :64], order)


def test_concat_rows_widens_mixed_formats_exactly() -> None:
    q4 = repack(torch.from_numpy(random_blocks("Q4_K", 3, 512, 1)), "Q4_K", 3, 512)
    q5 = repack(torch.from_numpy(random_blocks("Q5_0", 2, 512, 2)), "Q5_0", 2, 512)
    q6 = repack(torch.from_numpy(random_blocks("Q6_K", 4, 512, 3)), "Q6_K", 4, 512)
    assert (q6.bits, q6.group, q6.symmetric) == (6, 16, True)  # Q6_K stores no offsets
    # K-quants together (q/k Q4_K beside a Q6_K v, as Q4_K_M files have) keep integer
    # scales, and the symmetric part's offsets become explicit: exact.
    kq = concat_rows([q4, q6])
    assert (kq.bits, kq.group, kq.symmetric, kq.integer_scales) == (6, 16, False, True)
    assert torch.equal(dequantize(kq), torch.cat([dequantize(q4), dequantize(q6)]))
    # With a float16-scaled format every part takes float16 scales (rounded products):
    # then exact against those.
    both = concat_rows([q4, q5, q6])
    assert (both.bits, both.group, both.symmetric, both.integer_scales) == (6, 16, False, False)
    parts = [dequantize(p.with_float_scales()) for p in (q4, q5, q6)]
    assert torch.equal(dequantize(both), torch.cat(parts))
    exact = dequantize(q4)
    rounded = dequantize(q4.with_float_scales())  # float16's 2**-11 in each term
    assert (rounded - exact).abs().max() <= 2**-9 * exact.abs().max()
    same = concat_rows([q4, q4])
    assert (same.bits, same.group) == (4, 32) and same.shape == (6, 512)
    sixes = concat_rows([q6, q6.rows(torch.tensor([2, 0]))])  # symmetric parts stay so
    assert sixes.symmetric and torch.equal(dequantize(sixes)[4:], dequantize(q6)[[2, 0]])


def test_packaged_file_tensors_match_gguf(smollm2_path: Path) -> None:
    reader = GGUFReader(smollm2_path)
    for t in reader.tensors:
        if t.tensor_type.name not in FORMATS:
            continue
        cols = int(t.shape[0])
        raw = np.asarray(t.data)[:32]
        expected = gguf_dequantize(raw, t.tensor_type).reshape(-1, cols)
        got = dequantize(repack(torch.from_numpy(raw.copy()), t.tensor_type.name, 32, cols))
        np.testing.assert_array_equal(got.numpy(), expected)


def test_loader_keeps_weights_quantized_and_writes_no_float_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    legacy = settings.cache_dir() / "weights" / "old"
    legacy.mkdir(parents=True)
    (legacy / "model.safetensors").write_bytes(b"0" * 1000)
    loaded = load_model(None)
    assert not (tmp_path / "weights").exists()  # the old float32 cache is cleared
    quantized = {k: v for k, v in loaded.tensors.items() if isinstance(v, QuantizedTensor)}
    floats = {k: v for k, v in loaded.tensors.items() if not isinstance(v, QuantizedTensor)}
    c = loaded.config
    assert len(quantized) == 7 * c.num_layers + 1  # every linear and the embedding
    assert all("norm" in k for k in floats)
    assert quantized["model.embed_tokens.weight"].source == "Q8_0"
    assert quantized["model.layers.0.mlp.down_proj.weight"].source == "Q4_1"
    file_bytes = loaded.path.stat().st_size
    held = sum(t.nbytes for t in quantized.values())
    assert held <= 1.05 * file_bytes, (held, file_bytes)


def test_quantized_rope_rows_equal_the_dequantized_permutation() -> None:
    from sluice.loader import resolve_model_path
    from sluice.loader.gguf_loader import load_gguf

    path = resolve_model_path(None)
    _, kept, _ = load_gguf(path)
    _, floats, _ = load_gguf(path, keep_quantized=False)
    for name in (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
    ):
        q = kept[name]
        assert isinstance(q, QuantizedTensor)
        assert torch.equal(dequantize(q), floats[name])
