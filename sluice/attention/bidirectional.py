"""Attention both ways within each whole input: the encoders of embedding models.

A step's inputs arrive packed ([T] rows, with their lengths); attention pads them to
the longest (SDPA wants a rectangle) and masks the padding out of the keys. Nothing is
cached: an embedding input is computed in one pass. A sliding window here is two-sided
(EmbeddingGemma's local layers: a query sees keys less than `window` positions away,
before or after it, as transformers' bidirectional Gemma 3 does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sluice.attention.backend import AttentionBackend, AttentionMetadata

# A group of inputs attended together pads them to its longest; a new group starts where
# that padding would exceed this share of the group's tokens.
_MAX_PADDING = 0.25


@dataclass(frozen=True)
class SequenceGroup:
    """Inputs of similar length, consecutive in the packed batch (rows start..end), and
    their padded view: attention runs once per group."""

    start: int
    end: int
    lens: list[int]
    # Row of each of the group's tokens in its padded [B * L] view.
    pad_index: torch.Tensor
    # [B, L]: True where a padded slot holds a token.
    valid: torch.Tensor

    @classmethod
    def of(cls, start: int, lens: list[int], device: torch.device) -> SequenceGroup:
        length = torch.tensor(lens, device=device)
        valid = torch.arange(max(lens), device=device)[None, :] < length[:, None]
        pad_index = valid.reshape(-1).nonzero().squeeze(1)
        return cls(start, start + sum(lens), lens, pad_index, valid)

    @property
    def longest(self) -> int:
        return int(self.valid.shape[1])

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """The group's rows of a packed [T, ...] tensor -> [B, L, ...], zeros in the
        padding (no copy where no input is padded)."""
        mine = rows[self.start : self.end]
        b, length = self.valid.shape
        if b * length == mine.shape[0]:
            return mine.reshape(b, length, *rows.shape[1:])
        out = mine.new_zeros(b * length, *rows.shape[1:])
        out[self.pad_index] = mine
        return out.view(b, length, *rows.shape[1:])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> the group's [rows, ...]."""
        flat = padded.reshape(-1, *padded.shape[2:])
        return flat if flat.shape[0] == self.end - self.start else flat[self.pad_index]

    def key_mask(self, window: int | None = None) -> torch.Tensor | None:
        """[B, 1, L or 1, L] bool, True where a query may attend: the keys that are
        tokens, and within a two-sided window where one is given; None where every key
        may be attended (no padding, no window that matters)."""
        b, length = self.valid.shape
        near = None
        if window is not None and window < length:
            pos = torch.arange(length, device=self.valid.device)
            near = (pos[None, :] - pos[:, None]).abs() < window
        if b * length == self.end - self.start:
            return None if near is None else near[None, None]
        keys = self.valid[:, None, None, :]
        return keys if near is None else keys & near[None, None]


@dataclass(frozen=True)
class PackedSequences:
    """Where each input of a packed batch lies: its length, and the groups of inputs
    that attention pads together (consecutive inputs of similar length; the runner
    orders a step's inputs by length, so little is padded)."""

    lens: list[int]
    groups: list[SequenceGroup]

    @classmethod
    def of(cls, lens: list[int], device: torch.device) -> PackedSequences:
        groups: list[SequenceGroup] = []
        start, current = 0, list[int]()  # the group being filled
        for n in lens:
            grown = [*current, n]
            if current and max(grown) * len(grown) > (1 + _MAX_PADDING) * sum(grown):
                groups.append(SequenceGroup.of(start, current, device))
                start, grown = start + sum(current), [n]
            current = grown
        groups.append(SequenceGroup.of(start, current, device))
        return cls(lens, groups)

    def positions(self, device: torch.device) -> torch.Tensor:
        """Each token's index in its input, [T]."""
        length = torch.tensor(self.lens, device=device)
        starts = torch.cumsum(length, 0) - length
        total = int(length.sum())
        return torch.arange(total, device=device) - torch.repeat_interleave(starts, length)


# Inputs up to this long are attended with two batched matmuls and a softmax; longer ones
# with SDPA's fused kernel. On 2 Zen 4 cores, 12 heads of 32 in bf16 (ms, matmuls / SDPA):
# 128 inputs of 16 tokens 1.25 / 2.86, 32 of 64 2.67 / 3.89, 8 of 256 14.3 / 9.0.
_MATMUL_MAX_LEN = 64


def attend_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over padded inputs, [B, heads, L, D] (k and v may have fewer heads,
    shared by groups of query heads). mask: bool (True: may attend) or additive, or
    None for every key."""
    if q.shape[-2] > _MATMUL_MAX_LEN:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale or q.shape[-1] ** -0.5)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    return torch.matmul(scores.softmax(-1), v)


def attend_groups(
    seqs: PackedSequences,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: list[torch.Tensor | None],
    scale: float | None = None,
) -> torch.Tensor:
    """Attention within each input of a packed batch: q, k, v [T, heads, D] rows, one
    mask a group (`key_mask`, or an additive bias); [T, heads, D]."""
    outs = []
    for group, mask in zip(seqs.groups, masks, strict=True):
        qp, kp, vp = (group.pad(t).transpose(1, 2) for t in (q, k, v))  # [B, heads, L, D]
        outs.append(group.unpad(attend_padded(qp, kp, vp, mask, scale).transpose(1, 2)))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


@dataclass
class BidirectionalMetadata(AttentionMetadata):
    """A step of whole inputs: their layout, and the masks built at the first layer."""

    seqs: PackedSequences | None = None
    # Per window: each group's key mask, built at the first layer that needs it.
    masks: dict[int | None, list[torch.Tensor | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, seqs: PackedSequences) -> BidirectionalMetadata:
        return cls(slot_mapping=torch.empty(0, dtype=torch.long), seqs=seqs)


class BidirectionalBackend(AttentionBackend):
    """Every token of an input attends to every token of it (or those within its
    window); no KV cache is read or written."""

    name = "bidirectional"
    uses_row_mask = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert isinstance(meta, BidirectionalMetadata) and meta.seqs is not None
        if sinks is not None:  # no encoder has them; refused rather than ignored
            raise ValueError("attention sinks are not supported in an encoder's attention")
        if window not in meta.masks:
            meta.masks[window] = [group.key_mask(window) for group in meta.seqs.groups]
        return attend_groups(meta.seqs, q, k, v, meta.masks[window], scale)
