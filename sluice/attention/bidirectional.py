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


@dataclass(frozen=True)
class PackedSequences:
    """Where each input of a packed batch lies, and the padded view attention uses."""

    lens: list[int]
    # Row of each packed token in the padded [B * L] view.
    pad_index: torch.Tensor
    # [B, L]: True where a padded slot holds a token.
    valid: torch.Tensor

    @classmethod
    def of(cls, lens: list[int], device: torch.device) -> PackedSequences:
        longest = max(lens)
        length = torch.tensor(lens, device=device)
        valid = torch.arange(longest, device=device)[None, :] < length[:, None]
        pad_index = valid.reshape(-1).nonzero().squeeze(1)
        return cls(lens, pad_index, valid)

    @property
    def longest(self) -> int:
        return int(self.valid.shape[1])

    def positions(self) -> torch.Tensor:
        """Each token's index in its input, [T]."""
        steps = torch.arange(self.longest, device=self.valid.device)
        return steps.repeat(len(self.lens))[self.pad_index]

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, ...] packed -> [B, L, ...], zeros in the padding."""
        out = rows.new_zeros(len(self.lens) * self.longest, *rows.shape[1:])
        out[self.pad_index] = rows
        return out.view(len(self.lens), self.longest, *rows.shape[1:])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [T, ...]."""
        return padded.reshape(-1, *padded.shape[2:])[self.pad_index]

    def key_mask(self, window: int | None = None) -> torch.Tensor:
        """[B, 1, L or 1, L] bool, True where a query may attend: the keys that are
        tokens, and within a two-sided window where one is given."""
        keys = self.valid[:, None, None, :]
        if window is None:
            return keys
        pos = torch.arange(self.longest, device=keys.device)
        near = (pos[None, :] - pos[:, None]).abs() < window
        return keys & near[None, None]


@dataclass
class BidirectionalMetadata(AttentionMetadata):
    """A step of whole inputs: their layout, and the masks built at the first layer."""

    seqs: PackedSequences | None = None
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

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
    ) -> torch.Tensor:
        assert isinstance(meta, BidirectionalMetadata) and meta.seqs is not None
        seqs = meta.seqs
        if window not in meta.masks:
            meta.masks[window] = seqs.key_mask(window)
        qp, kp, vp = (seqs.pad(t).transpose(1, 2) for t in (q, k, v))  # [B, heads, L, D]
        out = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=meta.masks[window], scale=scale, enable_gqa=True
        )
        return seqs.unpad(out.transpose(1, 2))
