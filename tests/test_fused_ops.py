"""Our fused CPU ops against the plain torch ops they replace (the fallback path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice import kernels
from sluice.kernels import fused as kernel_ops
from sluice.layers import fused
from sluice.models.moe import route


@pytest.fixture
def fused_kernels(kernel_level: str) -> str:
    """Our fused ops at each instruction-set level this CPU has."""
    assert kernels.load() is not None and kernels.variant() == kernel_level
    return kernel_level


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.allclose(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])  # 300 x 576 takes the parallel branch
def test_rms_norm_with_and_without_residual(
    dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch, fused_kernels: str
) -> None:
    torch.manual_seed(0)
    x, res = (torch.randn(rows, 576, dtype=dtype) for _ in range(2))
    w = torch.randn(576, dtype=dtype)
    out, h = fused.rms_norm(x, w, 1e-5)
    add_out, add_h = fused.rms_norm(x, w, 1e-5, res.clone())
    monkeypatch.setattr(fused.kernels, "load", lambda: None)
    ref_out, _ = fused.rms_norm(x, w, 1e-5)
    ref_add_out, ref_add_h = fused.rms_norm(x, w, 1e-5, res.clone())
    assert h is x and close(out, ref_out, dtype)
    assert torch.equal(add_h, ref_add_h)  # the residual add is rounded exactly like torch's
    assert close(add_out, ref_add_out, dtype)


@pytest.mark.parametrize("rows", [1, 300])
def test_rms_norm_of_bf16_rows_with_fp32_scales(
    rows: int, monkeypatch: pytest.MonkeyPatch, fused_kernels: str
) -> None:
    """An encoder's norms keep 1 + w in fp32 (models/llama.py's _put_norm): the kernel
    reads them as fp32, as torch's norm in fp32 rounded once to bf16 does, and lands
    closer to the exact norm than with the scale rounded to bf16 first."""
    torch.manual_seed(2)
    x, res = (torch.randn(rows, 768, dtype=torch.bfloat16) * 20 for _ in range(2))
    w = 1.0 + torch.randn(768) * 0.01  # Gemma's scales: 1 plus a small stored offset
    out, _ = fused.rms_norm(x, w, 1e-6)
    add_out, add_h = fused.rms_norm(x, w, 1e-6, res.clone())
    rounded_scale, _ = fused.rms_norm(x, w.bfloat16(), 1e-6)
    monkeypatch.setattr(fused.kernels, "load", lambda: None)
    ref_out, _ = fused.rms_norm(x, w, 1e-6)
    ref_add_out, ref_add_h = fused.rms_norm(x, w, 1e-6, res.clone())
    assert close(out, ref_out, torch.bfloat16) and torch.equal(add_h, ref_add_h)
    assert close(add_out, ref_add_out, torch.bfloat16)
    exact = torch.nn.functional.rms_norm(x.double(), (768,), w.double(), 1e-6)

    def error(t: torch.Tensor) -> float:
        return float((t.double() - exact).abs().mean())

    assert error(out) < 0.8 * error(rounded_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_a_strided_slice(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, fused_kernels: str
) -> None:
    torch.manual_seed(1)
    t, heads, kv, d = 5, 4, 2, 64
    qkv = torch.randn(t, (heads + 2 * kv) * d, dtype=dtype)
    angles = torch.rand(t, 1, d // 2) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, : (heads + kv) * d].view(t, heads + kv, d)
    monkeypatch.setattr(fused.kernels, "load", lambda: None)
    ref = fused.rotate(qk.clone(), cos, sin)
    monkeypatch.undo()
    v_before = qkv[:, (heads + kv) * d :].clone()
    out = fused.rotate(qk, cos, sin)
    assert out is qk  # in place: the rotated tensor is the input view of qkv itself
    assert close(out, ref, dtype)
    assert torch.equal(qkv[:, (heads + kv) * d :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, fused_kernels: str
) -> None:
    gate_up = torch.randn(3, 2 * 1536, dtype=dtype) * 4
    out = fused.silu_and_mul(gate_up)
    monkeypatch.setattr(fused.kernels, "load", lambda: None)
    assert close(out, fused.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, fused_kernels: str
) -> None:
    # gpt-oss's activation (alpha 1.702, limit 7): values well past the limit on both
    # sides, so the clamps of gate (above only) and up (both ways) are exercised.
    gate_up = torch.randn(5, 2 * 640, dtype=dtype) * 6
    assert (gate_up.abs() > 7).any() and (gate_up < -7).any()
    out = fused.clamped_swiglu(gate_up, 1.702, 7.0)
    monkeypatch.setattr(fused.kernels, "load", lambda: None)
    assert close(out, fused.clamped_swiglu(gate_up, 1.702, 7.0), dtype)


@pytest.mark.parametrize(
    ("renormalize", "softmax_after_top_k", "bias"),
    [
        (False, False, False),
        (True, False, False),
        (True, False, True),
        (False, True, False),
        (False, True, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_route_as_the_reference_routes(
    renormalize: bool, softmax_after_top_k: bool, bias: bool, dtype: torch.dtype,
    fused_kernels: str,
) -> None:  # fmt: skip
    # Our routing kernel (the eager layer's and the decode stack's) against the torch
    # reference, with a router bias (gpt-oss) and a softmax over the top k (Granite-MoE,
    # gpt-oss): the same experts in the same order, weights to fp32 rounding.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    router = torch.randn(32, 96, generator=gen)
    b = torch.randn(32, generator=gen) * 3 if bias else None
    lib = kernels.load()
    assert lib is not None
    weights, ids = kernel_ops.moe_route(lib, x, router, 4, renormalize, b, softmax_after_top_k)
    logits = F.linear(x.float(), router, b)
    want_w, want_ids = route(logits, 4, renormalize, softmax_after_top_k)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_w, atol=1e-5)
    if softmax_after_top_k:  # the k weights alone sum to 1
        assert torch.allclose(weights.sum(-1), torch.ones(7))


def test_other_dtypes_and_layouts_use_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # With our kernels loaded (it once ran with them patched out, so the guard it is
    # named for was never on the path): float16 and strided rows take torch's op, a
    # contiguous float32 row ours.
    assert kernels.load() is not None
    calls: list[int] = []
    real = fused.fused_kernels.add_rms_norm
    monkeypatch.setattr(fused.fused_kernels, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 8, dtype=torch.float16)
    out, h = fused.rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-6)
    assert out.dtype == torch.float16 and h is x and not calls
    strided = torch.randn(2, 16)[:, ::2]
    fused.rms_norm(strided, torch.ones(8), 1e-6)
    assert not calls
    fused.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
    assert calls == [1]
