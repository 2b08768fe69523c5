"""BERT and MPNet: the bidirectional encoders of sentence-transformers' embedding models
(all-MiniLM-L6-v2, all-mpnet-base-v2).

The model is sluice/models/encoder.py. Their config.json speaks BERT's names (layer
norm epsilon, absolute positions, token types); MPNet adds relative position buckets,
counts positions from its padding id + 1, and names its attention weights its own way,
renamed here to BERT's. Neither comes in GGUF files here; both are safetensors only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.architectures.spec import ArchitectureSpec, Fields


def _encoder_fields(cfg: Mapping[str, Any]) -> Fields:
    act = str(cfg.get("hidden_act", "gelu"))
    if act != "gelu":
        raise ValueError(f"hidden_act {act!r} is not supported by the BERT encoder (gelu only)")
    embedding = cfg.get("position_embedding_type", "absolute")
    if embedding != "absolute":
        raise ValueError(f"position_embedding_type {embedding!r} is not supported (absolute only)")
    return dict(
        rms_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        hidden_act=act,
        attention_bias=True,
        bidirectional=True,
    )


def _bert_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    return {**_encoder_fields(cfg), "type_vocab_size": int(cfg.get("type_vocab_size", 2))}


def _mpnet_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    return {
        **_encoder_fields(cfg),
        "relative_attention_buckets": int(cfg.get("relative_attention_num_buckets", 32)),
        "position_offset": int(cfg.get("pad_token_id", 1)) + 1,
    }


BERT = ArchitectureSpec(
    name="bert",
    title="BERT",
    model="encoder",
    gguf_names=(),
    hf_classes=("BertModel", "BertForMaskedLM"),
    hf_fields=_bert_fields,
    hf_renames=(("bert.", ""),),
    tensor_parallel=False,
    eagle_head=False,
    encoder=True,
)

MPNET = ArchitectureSpec(
    name="mpnet",
    title="MPNet",
    model="encoder",
    gguf_names=(),
    hf_classes=("MPNetModel", "MPNetForMaskedLM"),
    hf_fields=_mpnet_fields,
    hf_renames=(
        ("mpnet.", ""),
        ("attention.attn.q.", "attention.self.query."),
        ("attention.attn.k.", "attention.self.key."),
        ("attention.attn.v.", "attention.self.value."),
        ("attention.attn.o.", "attention.output.dense."),
        ("attention.LayerNorm.", "attention.output.LayerNorm."),
        ("encoder.relative_attention_bias.", "relative_attention_bias."),
    ),
    tensor_parallel=False,
    eagle_head=False,
    encoder=True,
)
