"""Rotary position embeddings (the half-split "NeoX" form Hugging Face weights expect)."""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "longrope":  # Phi-3: each pair's divisor, long past the trained context
        long = max_positions > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"])
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope: {factors.numel()} factors for {inv_freq.numel()} pairs")
        return inv_freq / factors.to(torch.float64)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # a GGUF's rope_freqs.weight: each pair's divisor
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope frequency factors: {factors.numel()} for {inv_freq.numel()} rotary pairs"
            )
        return inv_freq / factors
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(
        "unsupported rope_scaling type "
        f"{kind!r} (supported: linear, llama3, longrope, yarn, freq_factors)"
    )


def _yarn(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (gpt-oss, Qwen long context): pairs that turn fewer than `beta_slow` times
    over the trained context are interpolated (divided by `factor`), those that turn
    more than `beta_fast` times kept, and a linear ramp between the two correction
    dims (floored and ceiled unless `truncate` is false, as gpt-oss sets) mixes them."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    fast = float(scaling.get("beta_fast") or 32.0)
    slow = float(scaling.get("beta_slow") or 1.0)

    def correction_dim(turns: float) -> float:
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's and YaRN's attention factor
    (given, or from how far the context was extended), else 1."""
    kind = scaling.get("rope_type") if scaling else None
    if not scaling or kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "yarn":  # DeepSeek's configs give both mscales; the ratio then
        factor = float(scaling["factor"])
        mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and all_dims:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dims))
        return _yarn_mscale(factor)
    factor, original = float(scaling["factor"]), int(scaling["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding:
    """Precomputed cos/sin tables; `lookup` once per step (applied by layers.fused.rotate).
    LongRoPE takes its long factors where `max_positions` (the context the engine
    serves) is past the trained context, its short ones otherwise, for every position
    (llama.cpp's rule; transformers switches per forward pass on the sequence's length,
    which agrees for a sequence inside the trained context and for one that starts
    past it)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: int | None = None,
    ) -> None:
        """`rotary_dim`: rope turns only that many of a head's dims (None: all), the
        model's q/k rows in ModelConfig.qk_row_order; the other pairs get cos 1, sin 0,
        the attention factor too (it scales the turned dims only)."""
        rotary_dim = rotary_dim or head_dim
        inv_freq = _inv_freq(rotary_dim, theta, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        mscale = _attention_factor(scaling)
        still = (max_positions, (head_dim - rotary_dim) // 2)
        cos = torch.cat([freqs.cos() * mscale, torch.ones(still, dtype=torch.float64)], 1)
        sin = torch.cat([freqs.sin() * mscale, torch.zeros(still, dtype=torch.float64)], 1)
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, D/2]: broadcasts over heads.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
