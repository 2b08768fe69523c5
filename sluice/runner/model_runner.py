"""Owns the model and the KV tensors; turns a scheduler output into one forward pass."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sluice.architectures import spec_of
from sluice.attention import AttentionBackend, AttentionMetadata, PrefillSpan
from sluice.attention.step import StepContext, step_context
from sluice.config import GLOBAL_KV_GROUP, ModelConfig
from sluice.core.choices import PoolingMode
from sluice.core.errors import ConfigError
from sluice.core.lora import LoRAAdapter
from sluice.core.request import Request
from sluice.layers.block_quant import weight_bytes
from sluice.layers.experts import Experts
from sluice.layers.lora import LoRAMapping, lora_step
from sluice.models.llama import LlamaForCausalLM
from sluice.models.llama_decode_stack import LlamaDecodeStack
from sluice.models.tp_shard import Collectives
from sluice.runner.kv_layout import KVLayout, KVPools
from sluice.runner.lora_table import LoRASlotTable


@dataclass
class ModelOutput:
    # Logits of the positions each request that samples this step samples at, in the
    # order of `sampling_requests`: its last computed position, or for a request
    # verifying k draft tokens the k + 1 positions from its last known token on.
    logits: torch.Tensor  # [sum(num_rows), vocab] fp32
    sampling_requests: list[Request]
    num_rows: list[int]  # rows of `logits` per sampling request, in order
    # Logits of every computed prompt position, for requests that asked for prompt logprobs.
    prompt_logits: dict[str, tuple[int, torch.Tensor]]  # request_id -> (first position, logits)
    # A runner built with return_features: each scheduled request's final-normed hidden
    # states, one row per token it computed (what an EAGLE head drafts from).
    features: dict[Request, torch.Tensor] | None = None
    # Embedding requests whose input is complete: request id -> its pooled vector
    # (before the per-request cut and normalization), fp32 on the CPU.
    pooled: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclass
class StepInputs:
    """A prepared step: what every rank of a tensor-parallel group runs (pickled to the
    workers), built once by rank 0."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], on CPU
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # rows of the hidden states that sample, on CPU
    prompt_rows: list[tuple[int, int]]  # row ranges whose prompt logprobs were asked for
    # The windowed layers' metadata of a split cache (their own block tables); None
    # with one pool.
    local_meta: AttentionMetadata | None = None
    # Per token, a feature the model takes beside the token (an EAGLE head's), or None.
    features: torch.Tensor | None = None
    # Rows whose final-normed hidden states embedding requests pool (on CPU), or None.
    pool_rows: torch.Tensor | None = None
    # Per token, the LoRA slot of its request's adapter (-1: none; int32 on CPU), or
    # None where no request of the step has an adapter.
    lora_slots: torch.Tensor | None = None

    def to(self, device: torch.device) -> StepInputs:
        """The same step with its device tensors on `device` (a CUDA rank's own GPU)."""
        if self.input_ids.device == device:
            return self
        return StepInputs(
            self.input_ids.to(device),
            self.positions,
            _moved(self.meta, device),
            self.logit_rows,
            self.prompt_rows,
            None if self.local_meta is None else _moved(self.local_meta, device),
            pool_rows=self.pool_rows,
            lora_slots=self.lora_slots,
        )


def _moved(obj: Any, device: torch.device) -> Any:
    """A dataclass (the attention metadata, its prefill spans) with every tensor, also in
    its lists and dicts, moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [_moved(v, device) for v in obj]
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _moved(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    return obj


@dataclass(frozen=True)
class PoolSpan:
    """An embedding request's rows in a step's pooled states: `count` rows from `first`;
    `start` is its chunk's first position, `completes` whether the chunk ends its prompt."""

    request: Request
    first: int
    count: int
    start: int
    completes: bool


class StepFollowers(Protocol):
    """The other ranks of a tensor-parallel group, as rank 0's runner drives them."""

    def run_step(self, inputs: StepInputs) -> None: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...

    def load_lora(self, loads: list[tuple[int, LoRAAdapter]]) -> None: ...


# A request computing at most this many tokens in a step is attended row by row (see
# execute); larger chunks go to SDPA, whose matmuls win once there are many queries.
SMALL_CHUNK_TOKENS = 16


def _check_expert_parallel(config: ModelConfig, world_size: int, expert_parallel: bool) -> None:
    """A Mixture-of-Experts model splits its experts over the ranks (expert parallel),
    whole experts each; its experts' units are not split."""
    if not expert_parallel:
        raise ConfigError(
            "tensor_parallel_size",
            "tensor_parallel_size > 1 splits a Mixture-of-Experts model's experts over the "
            "ranks: set enable_expert_parallel (splitting each expert's units is not "
            "implemented)",
        )
    if config.num_experts % world_size:
        raise ConfigError(
            "tensor_parallel_size",
            f"tensor_parallel_size={world_size} must divide the model's {config.num_experts} "
            "experts (expert parallel)",
        )
    if not config.qk_norm_per_head:
        raise ConfigError(
            "tensor_parallel_size",
            "tensor_parallel_size > 1 does not run OLMoE yet: its QK-norm spans every "
            "head, which the ranks split",
        )


def check_tensor_parallel(
    config: ModelConfig, world_size: int, expert_parallel: bool = False
) -> None:
    """Refuse, naming tensor_parallel_size, a model this many ranks cannot split
    (expert_parallel: enable_expert_parallel, how a MoE model is split)."""
    spec = spec_of(config.architecture)
    if not spec.tensor_parallel:
        raise ConfigError(
            "tensor_parallel_size", f"tensor_parallel_size > 1 does not run {spec.title} models yet"
        )
    if config.is_moe:
        _check_expert_parallel(config, world_size, expert_parallel)
    for what, count in (
        ("attention heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("intermediate size", config.intermediate_size),
    ):
        if count % world_size:
            raise ConfigError(
                "tensor_parallel_size",
                f"tensor_parallel_size={world_size} must divide the model's {what} "
                f"({config.name}: {config.num_heads} heads, {config.num_kv_heads} KV heads, "
                f"intermediate size {config.intermediate_size}); KV heads are not replicated",
            )


class ModelRunner:
    """One model's forward passes over its KV pools. Built whole by
    runner/factory.py's build_runner; this class only runs steps."""

    def __init__(
        self,
        *,
        config: ModelConfig,
        model: LlamaForCausalLM,
        forward: Callable[..., torch.Tensor],
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        layout: KVLayout,
        kv: KVPools,
        decode_stack: LlamaDecodeStack | None = None,
        tp: Collectives | None = None,
        followers: StepFollowers | None = None,
        return_features: bool = False,
        pool_mode: PoolingMode = "last",
        lora: LoRASlotTable | None = None,
    ) -> None:
        """config: this rank's (a tensor-parallel rank's slice); forward: the model or
        its compiled form; decode_stack: the fused C++ decode path where all of the
        model runs on our kernels; followers: rank 0's handle on the other ranks of a
        tensor-parallel group; return_features: every step's ModelOutput carries the
        final-normed hidden states of every token (what an EAGLE head drafts from);
        pool_mode: how embedding requests pool their prompt's final-normed states;
        lora: the model's adapter slots, where LoRA is enabled."""
        self.config = config
        self.model = model
        self.forward = forward
        self.backend = backend
        self.dtype = dtype
        self.device = device
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = layout.num_blocks
        self.local_num_blocks = layout.local_num_blocks
        self.kv_cache_dtype = layout.kv_cache_dtype
        self.kv_pools, self.kv_pool_groups, self.kv_caches = kv.pools, kv.pool_groups, kv.caches
        local = (
            set(config.split_kv_local_layers()) if layout.local_num_blocks is not None else set()
        )
        # Per layer, whether it reads the local group's metadata (empty: one pool).
        self.local_layers = [i in local for i in range(config.num_layers)] if local else []
        self.decode_stack = decode_stack
        self.tp = tp
        self.followers = followers
        self.return_features = return_features
        self.pool_mode = pool_mode
        self.lora = lora

    def expert_tokens(self) -> list[list[int]]:
        """Tokens routed to each expert of each Mixture-of-Experts layer since load,
        [layer][expert]; empty for a dense model."""
        return [m.tokens.tolist() for m in self.model.modules() if isinstance(m, Experts)]

    def weight_bytes(self) -> int:
        """Bytes of the model's weights as held in memory (see block_quant.weight_bytes)."""
        return weight_bytes(self.model)

    def copy_blocks(self, copies: list[tuple[int, int]], group: int = GLOBAL_KV_GROUP) -> None:
        """Copy-on-write: blocks src -> dst in the pools of cache group `group`."""
        if not copies:
            return
        if self.followers is not None:
            assert group == GLOBAL_KV_GROUP, "tensor parallelism runs one pool"
            self.followers.copy_blocks(copies)
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for pool, pool_group in zip(self.kv_pools, self.kv_pool_groups, strict=True):
            if pool_group == group:
                pool[:, :, dst] = pool[:, :, src]

    def read_block(self, block: int) -> torch.Tensor:
        """A copy of one block's bytes, every layer's K and V in every pool (a flat uint8
        tensor): what a KV connector saves. Built on the pools' block axis only, not their
        inner layout (an int8 pool's rows are bytes already). One pool only: the
        engine gives a split cache no KV connector."""
        assert not self.local_layers, "a split KV cache's blocks are not one block id"
        parts = [
            pool[:, :, block].clone(memory_format=torch.contiguous_format).view(torch.uint8)
            for pool in self.kv_pools
        ]
        return torch.cat([p.reshape(-1) for p in parts])

    def write_block(self, block: int, data: torch.Tensor) -> None:
        """Put bytes `read_block` gave (here or in an earlier process) into `block`."""
        assert not self.local_layers, "a split KV cache's blocks are not one block id"
        offset = 0
        for pool in self.kv_pools:
            target = pool[:, :, block]
            n = target.numel() * target.element_size()
            target.copy_(data[offset : offset + n].view(target.dtype).view(target.shape))
            offset += n

    def kv_block_layout(self) -> str:
        """Each pool's element type and one block's shape, e.g. float32[30,2,3,16,64], or
        float32[2,2,3,16,64]+uint8[28,2,3,16,68] with full-precision layers beside int8."""
        return "+".join(
            f"{str(p.dtype).removeprefix('torch.')}[{','.join(map(str, p[:, :, 0].shape))}]"
            for p in self.kv_pools
        )

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[tuple[Request, int]],
        features: dict[Request, torch.Tensor] | None = None,
    ) -> ModelOutput:
        """Run one step over (request, num_new_tokens) pairs, in any order; features:
        each request's per-token features ([num_new_tokens, hidden]), for a model that
        takes them (an EAGLE head)."""
        scheduled = sorted(scheduled, key=lambda rn: rn[1] > SMALL_CHUNK_TOKENS)
        inputs, sampling, rows_per_req, prompt_starts = self._prepare(scheduled)
        pool_spans = self._pool_spans(scheduled, inputs)
        inputs.lora_slots = self._lora_slots(scheduled)
        if features is not None:
            inputs.features = torch.cat([features[r] for r, _ in scheduled]).to(self.device)
        if self.followers is not None:
            self.followers.run_step(inputs)  # the other ranks run the same step
        logits, prompt_logits, normed, pooled = self.run_step(inputs)
        prompt = {
            rid: (start, chunk)
            for (rid, start), chunk in zip(prompt_starts, prompt_logits, strict=True)
        }
        out = ModelOutput(logits, sampling, rows_per_req, prompt)
        if pool_spans:
            assert pooled is not None
            out.pooled = self._pool(pool_spans, pooled)
        if normed is not None:
            starts = list(itertools.accumulate((n for _, n in scheduled), initial=0))
            spans = zip(scheduled, starts[:-1], starts[1:], strict=True)
            out.features = {r: normed[a:b] for (r, _), a, b in spans}
        return out

    def _pool_spans(
        self, scheduled: list[tuple[Request, int]], inputs: StepInputs
    ) -> list[PoolSpan]:
        """The rows each embedding request of the step pools (its last row once its prompt
        is complete, its first position's, or every row for a mean), set on `inputs`."""
        spans: list[PoolSpan] = []
        rows: list[int] = []
        offset = 0
        for req, n in scheduled:
            start = req.num_computed_tokens
            if req.pooling is not None:
                completes = start + n == req.num_prompt_tokens
                if self.pool_mode == "mean":
                    mine = list(range(offset, offset + n))
                elif self.pool_mode == "cls":
                    mine = [offset] if start == 0 else []
                else:
                    mine = [offset + n - 1] if completes else []
                spans.append(PoolSpan(req, len(rows), len(mine), start, completes))
                rows.extend(mine)
            offset += n
        if spans:
            inputs.pool_rows = torch.tensor(rows, dtype=torch.long)
        return spans

    def _lora_slots(self, scheduled: list[tuple[Request, int]]) -> torch.Tensor | None:
        """Each token's adapter slot, the step's adapters given slots first; None where
        no request has an adapter or this runner has no slots."""
        adapters = [r.lora for r, _ in scheduled if r.lora is not None]
        if not adapters or self.lora is None:  # a draft model drafts without adapters
            return None
        placed, loaded = self.lora.slots_for(adapters)
        if loaded and self.followers is not None:
            self.followers.load_lora(loaded)  # before the step that needs them
        per_request = [-1 if r.lora is None else placed[r.lora.key] for r, _ in scheduled]
        slots = torch.tensor(per_request, dtype=torch.int32)
        if all(n == 1 for _, n in scheduled):  # a decode step: a token a request
            return slots
        return slots.repeat_interleave(torch.tensor([n for _, n in scheduled]))

    def _pool(self, spans: list[PoolSpan], states: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each embedding request's pooled vector once its prompt is complete (fp32, on
        CPU); a mean's chunks add up on the request (its pool_state) until then."""
        pooled = {}
        states = states.float().cpu()
        for span in spans:
            req, part = span.request, states[span.first : span.first + span.count]
            if self.pool_mode == "mean":
                total = part.sum(0)
                req.pool_state = total if span.start == 0 else req.pool_state + total
            elif self.pool_mode == "cls" and span.start == 0:
                req.pool_state = part[0]
            elif self.pool_mode == "last" and span.completes:
                req.pool_state = part[-1]
            if span.completes:
                vector = req.pool_state
                if self.pool_mode == "mean":
                    vector = vector / req.num_prompt_tokens
                pooled[req.request_id] = vector
                req.pool_state = None
        return pooled

    @torch.inference_mode()
    def run_step(
        self, inputs: StepInputs
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """The forward pass of a prepared step: (the sampling rows' logits, each prompt
        chunk's logits, with return_features every token's final-normed hidden state,
        else None, and the final-normed states of inputs.pool_rows, else None). Every
        rank of a tensor-parallel group runs it on the same inputs; rank 0's logits are
        the whole vocabulary's."""
        meta = inputs.meta
        lora = None if inputs.lora_slots is None else LoRAMapping(inputs.lora_slots, self.device)
        stack = self.decode_stack
        if (
            stack is not None
            and (lora is None or stack.has_lora)
            and stack.accepts(inputs.input_ids.numel(), meta)
        ):
            with lora_step(lora):  # the embedding's adapters (the stack runs the layers')
                hidden = stack(inputs.input_ids, inputs.positions, meta, inputs.lora_slots)
        else:
            ctx = StepContext(self.backend, meta, self.kv_caches, self._layer_metadata(inputs))
            extra = () if inputs.features is None else (inputs.features,)
            with step_context(ctx), lora_step(lora):
                hidden = self.forward(inputs.input_ids, inputs.positions.to(self.device), *extra)
        prompt = [self._logits(hidden[a:b], lora, slice(a, b)) for a, b in inputs.prompt_rows]
        rows = inputs.logit_rows.to(self.device)
        pooled = None
        if inputs.pool_rows is not None:
            pooled = self.model.norm(hidden[inputs.pool_rows.to(self.device)])
        if not self.return_features:
            return self._logits(hidden[rows], lora, inputs.logit_rows), prompt, None, pooled
        normed = self.model.norm(hidden)  # the features, and the head's input: one norm
        logits = self._logits(normed[rows], lora, inputs.logit_rows, normed=True)
        return logits, prompt, normed, pooled

    def _logits(
        self,
        hidden: torch.Tensor,
        lora: LoRAMapping | None,
        rows: torch.Tensor | slice,
        normed: bool = False,
    ) -> torch.Tensor:
        """The head's logits for some of the step's rows, each with its adapter's head."""
        with lora_step(None if lora is None else lora.select(rows)):
            return self.model.compute_logits(hidden, normed=normed)

    def _layer_metadata(self, inputs: StepInputs) -> list[AttentionMetadata] | None:
        """Each layer's metadata where a split cache gives its groups their own; None
        where every layer reads `inputs.meta`."""
        local = inputs.local_meta
        if local is None:
            return None
        return [local if is_local else inputs.meta for is_local in self.local_layers]

    def _prepare(
        self, scheduled: list[tuple[Request, int]]
    ) -> tuple[StepInputs, list[Request], list[int], list[tuple[str, int]]]:
        """The step's tensors (token ids, positions, attention metadata), and which rows
        need logits: every request that catches up with its known tokens samples at its
        last known token and at each of its draft tokens; prompt positions too for
        prompt logprobs. Also (the sampling requests, rows per request, (request id,
        first position) of each prompt chunk)."""
        starts_l = [r.num_computed_tokens for r, _ in scheduled]
        lens_l = [n for _, n in scheduled]
        offsets = list(itertools.accumulate(lens_l, initial=0))  # batch offset per request
        token_ids = list(
            itertools.chain.from_iterable(
                _step_tokens(r, s, n) for (r, n), s in zip(scheduled, starts_l, strict=True)
            )
        )
        meta, local_meta, positions = self._metadata(scheduled, starts_l, lens_l, offsets)
        sampling: list[Request] = []
        rows: list[int] = []
        rows_per_req: list[int] = []
        prompt_rows: list[tuple[int, int]] = []
        prompt_starts: list[tuple[str, int]] = []
        for i, (r, n) in enumerate(scheduled):
            end = offsets[i + 1]
            count = starts_l[i] + n - r.num_tokens + 1
            if count > 0 and r.pooling is None:  # an embedding request samples nothing
                sampling.append(r)
                rows.extend(range(end - count, end))
                rows_per_req.append(count)
            if r.sampling_params.prompt_logprobs is not None and starts_l[i] < r.num_prompt_tokens:
                last = min(starts_l[i] + n, r.num_prompt_tokens)
                prompt_rows.append((end - n, end - n + (last - starts_l[i])))
                prompt_starts.append((r.request_id, starts_l[i]))
        inputs = StepInputs(
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions,
            meta,
            torch.tensor(rows, dtype=torch.long),
            prompt_rows,
            local_meta,
        )
        return inputs, sampling, rows_per_req, prompt_starts

    def _metadata(
        self,
        scheduled: list[tuple[Request, int]],
        starts_l: list[int],
        lens_l: list[int],
        offsets: list[int],
    ) -> tuple[AttentionMetadata, AttentionMetadata | None, torch.Tensor]:
        """The attention metadata (and a split cache's local group's, else None) and
        the positions of a step (requests computing few tokens first)."""
        dev = self.device
        bs = self.block_size
        n_req = len(scheduled)
        num_tokens = offsets[-1]
        starts = torch.tensor(starts_l, dtype=torch.long)
        lens = torch.tensor(lens_l, dtype=torch.long)
        cu = torch.tensor(offsets, dtype=torch.long)
        req_of_token = torch.repeat_interleave(torch.arange(n_req), lens)
        positions = starts[req_of_token] + torch.arange(num_tokens) - cu[:-1][req_of_token]

        table = _block_table([r.block_ids for r, _ in scheduled])
        slot_mapping = table[req_of_token, positions // bs] * bs + positions % bs

        # Requests computing few tokens (decodes, short chunks after a prefix-cache hit,
        # short prompts) come first and go to the paged kernel, which reads each K/V
        # block once per sequence in place; longer chunks go to SDPA, whose matmuls win
        # once a sequence has many queries.
        num_small = 0
        while num_small < n_req and lens_l[num_small] <= SMALL_CHUNK_TOKENS:
            num_small += 1
        num_rows = offsets[num_small]
        meta = AttentionMetadata(slot_mapping=slot_mapping.to(dev), num_small_tokens=num_rows)
        if num_rows:
            ctx_end = starts[:num_small] + lens[:num_small]
            nb = int((ctx_end.max().item() + bs - 1) // bs)
            meta.small_block_tables = table[:num_small, :nb].contiguous().to(dev)
            meta.small_query_start = cu[: num_small + 1].to(dev)
            meta.small_ctx_end = ctx_end.to(dev)
            if self.backend.uses_row_mask:
                row_req = req_of_token[:num_rows]
                meta.row_block_tables = table[row_req, :nb].to(dev)
                visible = positions[:num_rows] + 1
                mask = torch.arange(nb * bs) < visible[:, None]
                meta.row_mask = mask[:, None, None, :].to(dev)
                meta.row_positions = positions[:num_rows].to(dev)
        for i in range(num_small, n_req):
            start, n = starts_l[i], lens_l[i]
            span = PrefillSpan(q_start=offsets[i], q_len=n)
            if start > 0:
                ctx = start + n
                pos = torch.arange(ctx)
                span.context_slots = (table[i, pos // bs] * bs + pos % bs).to(dev)
                # Query j sits at position start + j and sees positions 0..start + j.
                span.mask = (pos[None, :] <= (start + torch.arange(n))[:, None]).to(dev)
            meta.prefills.append(span)
        local = None
        if self.local_layers:
            local_table = _block_table([r.local_block_ids for r, _ in scheduled])
            local = self._group_metadata(meta, local_table, positions, req_of_token)
        return meta, local, positions

    def _group_metadata(
        self,
        meta: AttentionMetadata,
        table: torch.Tensor,
        positions: torch.Tensor,
        req_of_token: torch.Tensor,
    ) -> AttentionMetadata:
        """`meta` over another cache group's block tables: its own slots and tables; the
        positions, query layout and masks are meta's own tensors, shared. (Released
        entries read as block 0 here too; the window keeps every path off them.)"""
        bs, dev = self.block_size, self.device
        n = meta.num_small_tokens
        slot_mapping = table[req_of_token, positions // bs] * bs + positions % bs
        view = dataclasses.replace(
            meta, slot_mapping=slot_mapping.to(dev), prefills=[], window_row_masks={}
        )
        if meta.small_block_tables is not None:
            num_small, nb = meta.small_block_tables.shape
            view.small_block_tables = table[:num_small, :nb].contiguous().to(dev)
            if meta.row_block_tables is not None:
                view.row_block_tables = table[req_of_token[:n], :nb].to(dev)
        first = table.shape[0] - len(meta.prefills)  # the spans' requests come last
        for i, span in enumerate(meta.prefills, start=first):
            slots = None
            if span.context_slots is not None:
                pos = torch.arange(span.context_slots.shape[0])
                slots = (table[i, pos // bs] * bs + pos % bs).to(dev)
            view.prefills.append(PrefillSpan(span.q_start, span.q_len, slots, span.mask))
        return view


def _block_table(tables: list[list[int]]) -> torch.Tensor:
    """[requests, max blocks] int64, padded with block 0. Blocks a sliding window has
    released (-1) read as block 0 too: no attention path reads a position before its
    window, and the gathers need a valid index."""
    max_blocks = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long).clamp_(
        min=0
    )


def _step_tokens(r: Request, start: int, n: int) -> list[int]:
    """The ids of positions start .. start + n - 1: known tokens, then draft tokens."""
    ids = r.all_token_ids[start : start + n]
    drafts = start + n - r.num_tokens
    if drafts > 0:
        assert drafts == len(r.spec_token_ids), "the scheduler trims drafts to what it grants"
        ids += r.spec_token_ids
    return ids
