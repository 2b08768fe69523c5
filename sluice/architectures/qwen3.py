"""Qwen3: the Llama decoder with an RMSNorm on each head's q and k (QK-norm)."""

from __future__ import annotations

from sluice.architectures.spec import ArchitectureSpec, Fields


def _qk_norm(*_: object) -> Fields:
    return {"qk_norm": True}


SPEC = ArchitectureSpec(
    name="qwen3",
    title="Qwen3",
    model="llama",
    gguf_names=("qwen3",),
    hf_classes=("Qwen3ForCausalLM",),
    gguf_fields=_qk_norm,
    hf_fields=_qk_norm,
)
