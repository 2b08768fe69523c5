"""Bidirectional encoders over a packed batch of whole sequences: BERT and MPNet, and a
decoder's layers run both ways (EmbeddingGemma).

A step's sequences arrive concatenated ([T] token ids, as the runner gives a decoder's),
with their lengths. Every linear layer runs on the packed rows, so no padding is ever
multiplied; only attention pads the sequences to the longest one (a key mask keeps the
padding out), because SDPA wants a rectangle. Encoders keep no KV cache: an embedding
request is one forward pass over its whole input.

BERT and MPNet share the post-layer-norm block; MPNet adds a relative position bias
(T5's bidirectional buckets, one table shared by every layer), starts its absolute
positions after the padding id and has no token types. Weight names are BERT's; the
MPNet spec renames its checkpoint's (sluice/architectures/bert.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sluice.attention.bidirectional import (
    BidirectionalBackend,
    BidirectionalMetadata,
    PackedSequences,
    SequenceGroup,
    attend_groups,
)
from sluice.attention.step import StepContext, step_context
from sluice.config import ModelConfig
from sluice.models.llama import LlamaForCausalLM


def relative_position_bucket(
    relative: torch.Tensor, num_buckets: int, max_distance: int = 128
) -> torch.Tensor:
    """T5's bidirectional buckets, as MPNet uses them: half the buckets for keys before
    the query, half after; exact distances up to a quarter of the buckets, then
    logarithmic up to max_distance."""
    half = num_buckets // 2
    n = -relative
    bucket = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    far = (
        exact
        + (
            torch.log(n.float().clamp(min=1) / exact)
            / math.log(max_distance / exact)
            * (half - exact)
        ).long()
    )
    return bucket + torch.where(n < exact, n, far.clamp(max=half - 1))


class EncoderLayer(nn.Module):
    """Self-attention and a GELU MLP, each added to its input and then layer-normed."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.heads = config.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.up = nn.Linear(h, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=eps)

    def forward(
        self, x: torch.Tensor, seqs: PackedSequences, masks: list[torch.Tensor | None]
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        attn = attend_groups(seqs, q, k, v, masks).reshape(x.shape[0], -1)
        x = self.attn_norm(x + self.out(attn))
        out: torch.Tensor = self.mlp_norm(x + self.down(F.gelu(self.up(x))))
        return out


class BertEncoder(nn.Module):
    """BERT or MPNet: embeddings, then post-norm layers; returns each token's last
    hidden state (what sentence-transformers pools)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, h) if config.type_vocab_size else None
        )
        self.embed_norm = nn.LayerNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        buckets = config.relative_attention_buckets
        self.relative_bias = nn.Embedding(buckets, config.num_heads) if buckets else None

    def forward(self, input_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        seqs = PackedSequences.of(lens, input_ids.device)
        positions = seqs.positions(input_ids.device) + self.config.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings.weight[0]  # one segment: type 0
        x = self.embed_norm(x)
        masks = [self._mask(group, x.dtype) for group in seqs.groups]
        for layer in self.layers:
            x = layer(x, seqs, masks)
        out: torch.Tensor = x
        return out

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """A BERT-named checkpoint (MPNet's renamed by its spec); a missing, extra or
        misshapen tensor is a ValueError naming it."""
        state = encoder_state(tensors, self.config.num_layers)
        own = self.state_dict()
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or extra:
            raise ValueError(f"encoder checkpoint: missing {missing[:4]}, unexpected {extra[:4]}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"encoder checkpoint: {name} has shape {tuple(tensor.shape)}, the model "
                    f"needs {tuple(own[name].shape)}"
                )
        self.load_state_dict(state)

    def _mask(self, group: SequenceGroup, dtype: torch.dtype) -> torch.Tensor | None:
        """What SDPA adds to a group's scores: the keys in padding masked out, and
        MPNet's relative position bias ([B or 1, heads or 1, L, L]); None: nothing."""
        keys = group.key_mask()
        if self.relative_bias is None:
            return keys
        pos = torch.arange(group.longest, device=group.valid.device)
        bucket = relative_position_bucket(
            pos[None, :] - pos[:, None], self.config.relative_attention_buckets
        )
        bias: torch.Tensor = self.relative_bias(bucket).permute(2, 0, 1)[None].to(dtype)
        if keys is None:
            return bias  # [1, H, L, L]
        return bias.masked_fill(~keys, torch.finfo(dtype).min)  # [B, H, L, L]


# Checkpoint names (BERT's; MPNet's are renamed to them) -> this module's parameters.
_GLOBAL_WEIGHTS = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
    "relative_attention_bias": "relative_bias",
}
_LAYER_WEIGHTS = {
    "attention.output.dense": "out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "mlp_norm",
}
# Checkpoint tensors an embedding model does not use: the position-id buffer and BERT's
# next-sentence pooler (sentence-transformers pools the token states itself).
_UNUSED = ("embeddings.position_ids", "pooler.", "lm_head.", "cls.")


def encoder_state(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A BERT-named checkpoint -> BertEncoder's state dict (query, key and value joined
    into one projection). The caller's load_state_dict(strict) names what is missing."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith(_UNUSED):
            continue
        stem, _, kind = name.rpartition(".")
        if stem in _GLOBAL_WEIGHTS:
            state[f"{_GLOBAL_WEIGHTS[stem]}.{kind}"] = tensor
            continue
        prefix, _, rest = stem.partition(".layer.")
        index, _, inner = rest.partition(".")
        if prefix != "encoder" or not index.isdigit() or int(index) >= num_layers:
            raise ValueError(f"unexpected tensor {name!r} in an encoder checkpoint")
        if inner in _LAYER_WEIGHTS:
            state[f"layers.{index}.{_LAYER_WEIGHTS[inner]}.{kind}"] = tensor
        elif inner not in ("attention.self.query", "attention.self.key", "attention.self.value"):
            raise ValueError(f"unexpected tensor {name!r} in an encoder checkpoint")
    for i in range(num_layers):
        for kind in ("weight", "bias"):
            parts = [
                tensors.get(f"encoder.layer.{i}.attention.self.{p}.{kind}")
                for p in ("query", "key", "value")
            ]
            if any(p is None for p in parts):
                raise ValueError(f"encoder layer {i} lacks its attention query/key/value {kind}")
            state[f"layers.{i}.qkv.{kind}"] = torch.cat([p for p in parts if p is not None])
    return state


class BidirectionalDecoder(nn.Module):
    """A decoder's layers run both ways over whole inputs (EmbeddingGemma: Gemma 3 with
    bidirectional attention): the same modules and kernels as generation, with attention
    through the bidirectional backend instead of the paged cache; returns each token's
    final-normed hidden state."""

    def __init__(self, decoder: LlamaForCausalLM) -> None:
        super().__init__()
        self.decoder = decoder
        self.backend = BidirectionalBackend()
        # No KV pools: the backend reads none, and the context wants one entry a layer.
        nothing = torch.empty(0)
        self.no_cache = [(nothing, nothing)] * decoder.config.num_layers

    def forward(self, input_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        seqs = PackedSequences.of(lens, input_ids.device)
        ctx = StepContext(self.backend, BidirectionalMetadata.of(seqs), self.no_cache)
        with step_context(ctx):
            hidden = self.decoder(input_ids, seqs.positions(input_ids.device))
        normed: torch.Tensor = self.decoder.norm(hidden)
        return normed
