"""Llama-family decoder: Llama 2/3, SmolLM, Mistral (sliding window), Qwen2 (QKV bias),
Qwen3 (QK-norm), the Mixture-of-Experts families (sluice/models/moe.py) and gpt-oss
(attention sinks, an output-projection bias). Gemma 3 (sluice/models/gemma3.py) reuses
its attention and loading.

It runs on the flat ragged batch of a step: tokens [T], positions [T]. Attention is
reached through the step context (sluice/attention/step.py), which holds the batch
layout and the paged KV cache, so the model's arguments are only tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from sluice.attention.step import attend
from sluice.config import ModelConfig
from sluice.core.choices import LoRATarget
from sluice.core.lora import MODEL_LAYER
from sluice.core.quantized_tensor import (
    QuantizedTensor,
    Weight,
    weight_rows,
)
from sluice.layers import fused
from sluice.layers.block_quant import BlockQuantized, Embedding
from sluice.layers.linear import Linear
from sluice.layers.rotary import RotaryEmbedding
from sluice.models.checkpoint import Checkpoint
from sluice.models.mlp import MLP
from sluice.models.moe import SparseMoE
from sluice.models.tp_shard import Collectives


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 like the reference implementations, then cast back.
        return fused.rms_norm(x, self.weight, self.eps)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the residual may be updated in place."""
        return fused.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.window = config.layer_window(layer_index)
        self.scale = config.attention_scale
        # q, k and v in one matmul: one weight read, one kernel launch.
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # gpt-oss: each head's sink logit, in fp32 as the paged kernel reads it.
        self.sinks = (
            nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
            if config.attention_sinks
            else None
        )
        # Per head (Qwen3, Gemma 3) or over the whole projection (OLMoE).
        self.qk_norm_per_head = config.qk_norm_per_head
        if config.qk_norm:
            q_dim, k_dim = (
                (self.head_dim, self.head_dim)
                if self.qk_norm_per_head
                else (self.q_size, self.kv_size)
            )
            self.q_norm: RMSNorm | None = RMSNorm(q_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(k_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Contiguous copies: the fused norm then runs at every row count, as in the
            # one-call decode stack (sluice/models/llama_decode_stack.py).
            if self.qk_norm_per_head:
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                qk = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous())], dim=1)
            else:
                q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
                normed = [self.q_norm(q.contiguous()), self.k_norm(k.contiguous())]
                qk = torch.cat(normed, dim=1).view(t, -1, self.head_dim)
        # q and k heads rotate together, in place where fused.
        q, k = fused.rotate(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = attend(q, k, v, self.layer_index, self.window, self.scale, self.sinks)
        projected: torch.Tensor = self.o_proj(out.reshape(t, self.q_size))
        return projected


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config)
            if config.is_moe
            else MLP(config.hidden_size, config.intermediate_size)
        )
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1.0: none

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); their sum is the
        layer's output. Carrying the two apart lets each residual add fuse into the
        following RMSNorm."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        x = self.self_attn(x, cos, sin)
        m = self.residual_multiplier
        x, residual = self.post_attention_layernorm.add_forward(x if m == 1.0 else x * m, residual)
        out = self.mlp(x)
        return out if m == 1.0 else out * m, residual


class LlamaForCausalLM(nn.Module):
    # What a subclass changes: its MLP's activation, its decoder layer.
    hidden_acts: tuple[str, ...] = ("silu",)
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in self.hidden_acts:
            raise ValueError(
                f"unsupported hidden_act {config.hidden_act!r} for {config.architecture} "
                f"(supported: {', '.join(self.hidden_acts)})"
            )
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        # A ModuleList (it registers the layers), typed as the sequence of DecoderLayers
        # it is: nn.Module's attribute typing would make each item a Tensor | Module.
        self.layers = cast(
            Sequence[DecoderLayer],
            nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers)),
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.rotary: RotaryEmbedding | None = None
        # Tensor parallelism (set_tensor_parallel): this rank's group, and the first id
        # and size of the whole vocabulary, of which this model holds a slice.
        self.tp: Collectives | None = None
        self.vocab_start = 0
        self.full_vocab_size = config.vocab_size
        # restrict_output: the vocabulary ids the head's rows are, in order (None: all).
        self.output_ids: torch.Tensor | None = None

    def restrict_output(self, token_ids: torch.Tensor) -> None:
        """Compute logits for these vocabulary ids only, in this order: column j of the
        logits is token_ids[j]. A draft model's head over its frequent tokens reads a
        fraction of the head's bytes each step. Call before the weights are loaded."""
        self.output_ids = token_ids
        self.lm_head = Linear(self.config.hidden_size, len(token_ids))

    def set_tensor_parallel(self, tp: Collectives, full_vocab_size: int) -> None:
        """Make this model one rank of `tp` (built from tp_shard.local_config, loaded
        with tp_shard.shard_checkpoint): an all-reduce after each row-parallel layer,
        the vocabulary in slices."""
        self.tp = tp
        self.vocab_start = tp.rank * self.config.vocab_size
        self.full_vocab_size = full_vocab_size
        for layer in self.layers:
            layer.self_attn.o_proj.reduce = tp.all_reduce
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.split_experts(tp)  # expert parallel
            else:
                layer.mlp.down_proj.reduce = tp.all_reduce

    def lora_linears(self) -> list[tuple[int, Linear, tuple[LoRATarget, ...], tuple[int, ...]]]:
        """The Linears a LoRA adapter may adapt: (layer, the Linear, the projections it
        fuses in output order, their output widths); the head's layer is MODEL_LAYER.
        A Mixture-of-Experts layer's experts are not adapted. (The embedding, not a
        Linear, has slots of its own.)"""
        head: tuple[LoRATarget, ...] = ("lm_head",)
        out: list[tuple[int, Linear, tuple[LoRATarget, ...], tuple[int, ...]]] = [
            (MODEL_LAYER, self.lm_head, head, (self.lm_head.out_features,))
        ]
        hidden = self.config.hidden_size
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            widths = (att.q_size, att.kv_size, att.kv_size)
            out.append((i, att.qkv_proj, ("q_proj", "k_proj", "v_proj"), widths))
            out.append((i, att.o_proj, ("o_proj",), (hidden,)))
            if isinstance(layer.mlp, MLP):
                inter = layer.mlp.inter
                out.append((i, layer.mlp.gate_up_proj, ("gate_proj", "up_proj"), (inter, inter)))
                out.append((i, layer.mlp.down_proj, ("down_proj",), (hidden,)))
        return out

    def init_rotary(self, max_positions: int) -> None:
        c = self.config
        self.rotary = RotaryEmbedding(
            c.head_dim,
            max_positions,
            c.rope_theta,
            c.rope_scaling,
            self.embed_tokens.weight.dtype,
            self.embed_tokens.weight.device,
            rotary_dim=c.rotary_dim,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm (inside a step_context)."""
        assert self.rotary is not None, "call init_rotary() first"
        cos, sin = self.rotary.lookup(positions)
        h = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        out: torch.Tensor = h if residual is None else h + residual
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The layers' input for input_ids: their embeddings (Granite's scaled), a new
        tensor (the fused decode stack writes its output into it)."""
        h = self.embed_tokens(input_ids) if self.tp is None else self._embed_slice(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite
            h = h * self.config.embedding_multiplier
        return h

    def _embed_slice(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its slice, zeros for the
        rest, and the all-reduce assembles every row."""
        assert self.tp is not None
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.config.vocab_size)
        h: torch.Tensor = self.embed_tokens(local.masked_fill(outside, 0))
        h.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(h)

    def compute_logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """fp32 logits [rows, vocab] (normed: `hidden` has been through the final norm
        already). Under tensor parallelism every rank computes its vocabulary slice and
        rank 0 gets them all; the other ranks get their slice."""
        logits: torch.Tensor = self.lm_head(hidden if normed else self.norm(hidden))
        if self.tp is not None:
            gathered = self.tp.gather_last_dim(logits)
            if gathered is not None:
                logits = gathered[:, : self.full_vocab_size].contiguous()
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, Weight]) -> None:
        """Take Hugging Face-named weights, fusing q/k/v and gate/up (consumes
        `tensors`: each entry is removed as it is loaded). Quantized ones (a GGUF's)
        stay quantized where the layer's method keeps them (BlockQuantized), else are
        dequantized into the model's dtype."""
        ck = Checkpoint(tensors, self.embed_tokens.weight.dtype)
        embed = ck.take("model.embed_tokens.weight")
        if isinstance(embed, QuantizedTensor) and isinstance(self.lm_head.method, BlockQuantized):
            self.embed_tokens.load_quantized(embed)
        else:
            ck.put(self.embed_tokens.weight, embed)
        for i, layer in enumerate(self.layers):
            self._load_layer(ck, layer, f"model.layers.{i}.")
        self._put_norm(ck, self.norm, "model.norm.weight")
        self._load_head(ck)
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weight(module)

    def _load_layer(self, ck: Checkpoint, layer: DecoderLayer, p: str) -> None:
        """One decoder layer's weights, names prefixed with `p`."""
        att = layer.self_attn
        if self.config.rotary_dim is not None:
            self._reorder_for_partial_rotary(ck, p)
        ck.put_linear(att.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        if att.qkv_proj.bias is not None:  # config.attention_bias
            biases = [ck.dense(ck.take(p + f"self_attn.{n}_proj.bias")) for n in "qkv"]
            ck.put(att.qkv_proj.bias, torch.cat(biases))
        ck.put_linear(att.o_proj, [p + "self_attn.o_proj.weight"])
        if att.o_proj.bias is not None:  # config.o_proj_bias
            ck.put(att.o_proj.bias, ck.dense(ck.take(p + "self_attn.o_proj.bias")))
        if att.sinks is not None:  # config.attention_sinks
            ck.put_float(att.sinks, p + "self_attn.sinks.weight")
        if att.q_norm is not None and att.k_norm is not None:
            self._put_norm(ck, att.q_norm, p + "self_attn.q_norm.weight")
            self._put_norm(ck, att.k_norm, p + "self_attn.k_norm.weight")
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            head = self.lm_head.method  # the model's quantization, as every Linear has it
            int8_prompts = isinstance(head, BlockQuantized) and head.int8_prompts
            mlp.load(ck, p + "mlp.", isinstance(head, BlockQuantized), int8_prompts)
        else:
            ck.put_linear(mlp.gate_up_proj, [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")])
            ck.put_linear(mlp.down_proj, [p + "mlp.down_proj.weight"])
        self._put_norm(ck, layer.input_layernorm, p + "input_layernorm.weight")
        self._put_norm(ck, layer.post_attention_layernorm, p + "post_attention_layernorm.weight")

    def _reorder_for_partial_rotary(self, ck: Checkpoint, p: str) -> None:
        """q's and k's rows, biases and norms in ModelConfig.qk_row_order."""
        c = self.config
        head = c.qk_row_order(1)
        for n, heads in (("q", c.num_heads), ("k", c.num_kv_heads)):
            rows = c.qk_row_order(heads)
            assert rows is not None and head is not None
            orders = {"proj.weight": rows, "proj.bias": rows}
            orders["norm.weight"] = head if c.qk_norm_per_head else rows
            for suffix, index in orders.items():
                name = f"{p}self_attn.{n}_{suffix}"
                if name in ck.tensors:
                    ck.tensors[name] = weight_rows(ck.tensors[name], index)

    def _put_norm(self, ck: Checkpoint, norm: RMSNorm, name: str) -> None:
        """An RMSNorm's weight. An encoder (a decoder's layers run both ways for
        embeddings) keeps it in fp32 whatever the model's dtype, as transformers computes
        the scale: Gemma's stored offsets from 1 lose most of their digits once 1 + w is
        rounded to bf16, which moved EmbeddingGemma's vectors off the fp32 reference
        where transformers' own bf16 stays on it."""
        scale = self._norm_scale(ck, ck.take(name))
        if self.config.bidirectional:
            norm.weight = nn.Parameter(ck.dense_float(scale), requires_grad=False)
        else:
            ck.put(norm.weight, scale)

    def _norm_scale(self, ck: Checkpoint, stored: Weight) -> Weight:
        """What an RMSNorm multiplies by, from its stored weight (Gemma's add 1)."""
        return stored

    def _load_head(self, ck: Checkpoint) -> None:
        """A separate output weight, or the embedding's (tied: one copy in memory); only
        the rows of output_ids where the output is restricted."""
        ids = self.output_ids
        if not self.config.tie_word_embeddings and "lm_head.weight" in ck.tensors:
            if ids is not None:
                ck.tensors["lm_head.weight"] = weight_rows(ck.tensors["lm_head.weight"], ids)
            ck.put_linear(self.lm_head, ["lm_head.weight"])
            return
        quantized = self.embed_tokens.quantized
        if quantized is not None and isinstance(self.lm_head.method, BlockQuantized):
            rows = quantized if ids is None else quantized.rows(ids)
            self.lm_head.method.load_quantized(self.lm_head, rows, shared=ids is None)
            return
        tied = self.embed_tokens.weight
        assert isinstance(tied, nn.Parameter)
        if ids is not None:  # a copy of the rows kept: the embedding needs them all
            self.lm_head.weight = nn.Parameter(tied.detach()[ids], requires_grad=False)
            return
        self.lm_head.weight = tied
