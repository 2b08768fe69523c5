"""One tensor-parallel rank's part of a Llama-family checkpoint, cut at load time.

Column-parallel (outputs split): q/k/v by heads (K/V heads too, so each rank's KV pool
holds its own heads), gate/up by rows of the intermediate size, and their biases.
Row-parallel (inputs split): o_proj and down_proj by columns; their partial outputs are
all-reduced, and a bias on them is kept by rank 0 alone so the sum adds it once.
Expert-parallel (Mixture-of-Experts layers): each rank keeps whole experts, 1/N of
them, with their biases (gpt-oss); the router and Qwen2-MoE's shared expert are
replicated (sluice/models/moe.py). gpt-oss's sink logits go with their query heads.
Vocab-parallel: the embedding and the output head by rows of the vocabulary, padded
to equal slices (the padding rows are zeros: never looked up, and their logits are cut
off after the gather). A tied head takes the same slice as the embedding.

GGUF weights stay in their blocks. A row slice is exact in every layout. A column
slice of the in-memory layout (`QuantizedTensor`, repacked at load into groups of 16
or 32 in pairs of 32-blocks) is exact where both ends fall on a 64-value pair, and on
a 256-value super-block for integer scales (the K-quants); a K-quant cut on a pair
but not a super-block takes float16 scales (`with_float_scales`, rounded as fp16
rounds) and stays quantized. Qwen2.5-0.5B at N = 2: o_proj's 896 / 2 = 448 and down's
4864 / 2 = 2432 are both multiples of 64. Where a slice is not, that one shard is
dequantized to the compute dtype (and logged).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Protocol

import torch

from sluice.config import ModelConfig
from sluice.core.quantized_tensor import SUPER, QuantizedTensor, Weight, dequantize, weight_rows

logger = logging.getLogger("sluice")


# Columns of the in-memory block layout that travel together (a pair of 32-blocks).
PAIR = 64


class Collectives(Protocol):
    """What the model needs of its tensor-parallel group (sluice.parallel.TPGroup)."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None: ...


def vocab_slice(vocab_size: int, world_size: int) -> int:
    """Rows of the vocabulary each rank holds (the last one padded)."""
    return -(-vocab_size // world_size)


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one rank's model is built with."""
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        vocab_size=vocab_slice(config.vocab_size, world_size),
    )


def _rows(w: Weight, start: int, stop: int) -> Weight:
    """Rows start..stop as their own tensors (a view would keep the whole one alive)."""
    return weight_rows(w, torch.arange(start, stop))


def _padded_rows(w: Weight, start: int, rows: int) -> Weight:
    """`rows` rows from `start`, zero rows past the end (a vocabulary's last slice)."""
    stop = min(start + rows, w.shape[0])
    part = _rows(w, start, stop)
    missing = rows - (stop - start)
    if not missing:
        return part
    if isinstance(part, QuantizedTensor):
        # scale = minimum = 0 dequantizes to zeros whatever the packed bits.
        def pad(t: torch.Tensor) -> torch.Tensor:
            if not t.numel():
                return t
            return torch.cat([t, t.new_zeros(missing, *t.shape[1:])])

        return dataclasses.replace(
            part,
            packed=pad(part.packed),
            hbits=pad(part.hbits),
            scale=pad(part.scale),
            minimum=pad(part.minimum),
            super_scale=pad(part.super_scale),
        )
    return torch.cat([part, part.new_zeros(missing, *part.shape[1:])])


def _columns(w: Weight, start: int, stop: int, name: str, dtype: torch.dtype) -> Weight:
    """Columns start..stop; a block-quantized weight stays in blocks where the cut falls
    on a 64-value pair, else that shard is dequantized."""
    if not isinstance(w, QuantizedTensor):
        return w[:, start:stop].clone()
    if start % PAIR or stop % PAIR:
        logger.info(
            "tensor parallel: %s cut at columns %d..%d, not on %d-value block pairs: "
            "this shard is dequantized to %s",
            name,
            start,
            stop,
            PAIR,
            dtype,
        )
        return dequantize(w, torch.float32)[:, start:stop].to(dtype).clone()
    if w.integer_scales and (start % SUPER or stop % SUPER):
        w = w.with_float_scales()
    per_byte = 1 if w.bits == 8 else 2  # values per packed byte
    per_hbyte = {5: 8, 6: 4}.get(w.bits, 1)  # values per hbits byte

    def cut(t: torch.Tensor, per: int) -> torch.Tensor:
        return t[:, start // per : stop // per].contiguous() if t.numel() else t

    return dataclasses.replace(
        w,
        packed=cut(w.packed, per_byte),
        hbits=cut(w.hbits, per_hbyte),
        scale=cut(w.scale, w.group),
        minimum=cut(w.minimum, w.group),
        super_scale=w.super_scale[..., start // SUPER : stop // SUPER].contiguous()
        if w.integer_scales
        else w.super_scale,
    )


# Stacked expert projections and (gpt-oss) their biases [E, out]: whole experts a rank.
_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\w+_proj\.(weight|bias)")
# gpt-oss's sink logit per query head: a rank's heads' own.
_SINKS = re.compile(r"model\.layers\.\d+\.self_attn\.sinks\.weight")


def _experts(w: Weight, num_experts: int, rank: int, world_size: int) -> Weight:
    """Expert parallelism: this rank's 1/N of a stacked expert projection ([E, out, in]
    dense, or [E * out, in] rows in blocks), whole experts each."""
    per_rank = num_experts // world_size
    if isinstance(w, QuantizedTensor):
        rows = w.shape[0] // num_experts * per_rank
        return _rows(w, rank * rows, (rank + 1) * rows)
    return w[rank * per_rank : (rank + 1) * per_rank].clone()


_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)")


def shard_checkpoint(
    tensors: dict[str, Weight],
    config: ModelConfig,
    rank: int,
    world_size: int,
    dtype: torch.dtype,
) -> None:
    """Replace every weight in `tensors` (Hugging Face names) by this rank's part, in
    place, one tensor at a time so the whole model is never held twice."""
    d = config.head_dim
    q_rows = config.num_heads // world_size * d
    kv_rows = config.num_kv_heads // world_size * d
    inter = config.intermediate_size // world_size
    vocab = vocab_slice(config.vocab_size, world_size)
    for name in list(tensors):
        w = tensors[name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[name] = _padded_rows(w, rank * vocab, vocab)
            continue
        if _EXPERTS.fullmatch(name):
            tensors[name] = _experts(w, config.num_experts, rank, world_size)
            continue
        if _SINKS.fullmatch(name):
            heads = config.num_heads // world_size
            tensors[name] = _rows(w, rank * heads, (rank + 1) * heads)
            continue
        match = _LAYER.fullmatch(name)
        if match is None:
            continue  # norms, the MoE router and shared expert are replicated
        proj, kind = match.group(2), match.group(3)
        if proj in ("q", "k", "v", "gate", "up"):
            rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}.get(proj, inter)
            tensors[name] = _rows(w, rank * rows, (rank + 1) * rows)
        elif kind == "bias":  # o_proj / down_proj: added once, after the all-reduce
            assert isinstance(w, torch.Tensor), name  # biases are never block-quantized
            tensors[name] = w if rank == 0 else torch.zeros_like(w)
        else:
            cols = q_rows if proj == "o" else inter
            tensors[name] = _columns(w, rank * cols, (rank + 1) * cols, name, dtype)
