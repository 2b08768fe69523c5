"""LLMEngine.step(): schedule → run the model → sample → update requests → outputs.

The engine is built whole by builder.py (`LLMEngine.from_config`) and holds its parts
for life; what changes as it runs is plain Python state: the requests, the counters,
and the KV connector (attach_kv_connector) and speculator, which can be set aside."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from sluice.config import LOCAL_KV_GROUP, EngineConfig
from sluice.core.errors import ConfigError, RequestError
from sluice.core.lora import LoRAAdapter, LoRARequest
from sluice.core.request import DraftRow, Request, RequestStatus, SamplingRow
from sluice.engine.builder import EngineParts, build_engine, kv_block_format
from sluice.engine.kv_connector import BlockFormat, KVConnector
from sluice.engine.pooling import embedding_input, finish_vector, text_head
from sluice.engine.request_output import (
    RequestGroup,
    SampledLogprob,
    add_logprobs,
    add_prompt_logprobs,
    make_output,
    new_group,
)
from sluice.engine.scheduler import SchedulerOutput
from sluice.engine.speculative.shadow import ShadowProposer
from sluice.engine.stats import EngineStats, ratio
from sluice.engine.tensor_parallel import TensorParallelWorkers
from sluice.outputs import RequestOutput
from sluice.parallel import TPGroup
from sluice.runner.model_runner import ModelOutput, ModelRunner
from sluice.runner.spec_verify import accepted_length
from sluice.sampling_params import PoolingParams, SamplingParams
from sluice.structured import ConstraintMasks, advance, forced_tokens

logger = logging.getLogger("sluice")

# What an embedding request carries as sampling options: it samples nothing, but the
# runner and the scheduler read a request's (prompt logprobs, priorities).
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


@dataclass
class _WasteCounter:
    allocated_slots: int = 0
    used_slots: int = 0

    @property
    def fraction(self) -> float:
        return 1.0 - self.used_slots / self.allocated_slots if self.allocated_slots else 0.0


class LLMEngine:
    def __init__(self, parts: EngineParts) -> None:
        """An engine over finished parts (build them with `from_config`)."""
        self.parts = parts
        self.config = parts.config
        self.model_config = parts.model_config
        self.model_path = parts.model_path
        self.tokenizer = parts.tokenizer
        self.dtype = parts.options.dtype
        self.quantization = parts.options.quantization
        self.max_model_len = parts.layout.max_model_len
        self.kv_cache_dtype = parts.kv_cache_dtype
        self.kv, self.runner, self.scheduler = parts.kv, parts.runner, parts.scheduler
        self.sampler, self.grammars = parts.sampler, parts.grammars
        self.constraint_masks = ConstraintMasks(parts.model_config.vocab_size)
        self.cpu_kernels = parts.cpu_kernels
        # How embedding requests become vectors (an encoder's pipeline, or a decoder's
        # last token).
        self.pooler = parts.pooler
        # The LoRA adapters it serves (None without enable_lora).
        self.lora = parts.lora
        # The token the tokenizer appends to every input (BERT's [SEP]), kept when an
        # embedding input is truncated; None where it appends none.
        self._end_token = self.tokenizer.appended_token()
        self.startup_seconds = parts.startup_seconds
        self.weight_bytes = parts.runner.weight_bytes()
        # State: set aside or replaced while the engine runs (tests, a new disk tier).
        self.speculator = parts.speculator
        self.kv_connector = parts.kv_connector
        self.tensor_parallel = parts.tensor_parallel
        self.groups: dict[str, RequestGroup] = {}
        self._seqs: dict[str, Request] = {}
        self.waste = _WasteCounter()
        self.num_steps = 0
        self.num_generated_tokens = 0
        # Per LoRA adapter name: requests run through it, tokens generated (/metrics).
        self.lora_requests: dict[str, int] = {}
        self.lora_tokens: dict[str, int] = {}
        self.num_forced_tokens = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(build_engine(config))

    @property
    def draft(self) -> ShadowProposer[Any, Any] | None:
        """The drafter that runs a model of its own (a draft model, an EAGLE head)."""
        spec = self.parts.speculator
        proposer = spec.proposer if spec is not None else None
        return proposer if isinstance(proposer, ShadowProposer) else None

    @property
    def tp_workers(self) -> TensorParallelWorkers | None:
        return self.tensor_parallel.workers if self.tensor_parallel else None

    @property
    def tp_group(self) -> TPGroup | None:
        return self.tensor_parallel.group if self.tensor_parallel else None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (and finish the KV connector's saves); the
        engine cannot step after this."""
        self.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
            self.tensor_parallel = None

    def kv_block_format(self) -> BlockFormat:
        """What one KV block's bytes mean here: a stored block is reused only where all
        of it matches."""
        options = self.parts.options
        if not isinstance(self.runner, ModelRunner):
            raise ConfigError("model", "an embedding encoder keeps no KV blocks")
        return kv_block_format(self.config, self.model_path, options, self.runner)

    # ---- requests in ----------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "prompt must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise RequestError("prompt", "prompt must be a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(
                "prompt", f"token id {bad[0]} is out of range [0, {self.model_config.vocab_size})"
            )
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request: one that generates (SamplingParams) or, on a model that
        embeds, one that pools its prompt into a vector (PoolingParams); with
        `lora_request`, through that LoRA adapter (loaded now if it is not in memory)."""
        adapter = self._adapter(lora_request)
        if isinstance(params, PoolingParams):
            self._add_pooling(request_id, prompt, params, priority, arrival_time)
            self._seqs[request_id].lora = adapter
            self._count_lora_request(adapter)
            return
        if self.model_config.bidirectional:
            raise RequestError(
                "model",
                "this is an embedding model: it does not generate text (embed with "
                "/v1/embeddings or LLM.embed)",
            )
        params = params or SamplingParams()
        ids = self._check_request(request_id, prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        constraint = params.structured_output
        # Compiled (or found in the cache) before anything is queued: a bad grammar is
        # this request's error, never the engine's.
        grammar = self.grammars.compile(constraint) if constraint is not None else None
        group = new_group(
            request_id, prompt, ids, params, self.tokenizer, grammar, priority, arrival
        )
        for seq in group.seqs:
            seq.lora = adapter
        self.groups[request_id] = group
        self._seqs.update((seq.request_id, seq) for seq in group.seqs)
        self.scheduler.add(group.seqs[0])
        self._count_lora_request(adapter)

    def _count_lora_request(self, adapter: LoRAAdapter | None) -> None:
        if adapter is not None:
            self.lora_requests[adapter.name] = self.lora_requests.get(adapter.name, 0) + 1

    def _adapter(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The loaded adapter a request names (None: the base model)."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise RequestError("lora_request", "lora_request must be a LoRARequest")
        if self.lora is None:
            raise RequestError(
                "lora_request", "LoRA adapters need the engine started with enable_lora=True"
            )
        return self.lora.resolve(lora_request)

    def _add_pooling(
        self,
        request_id: str,
        prompt: str | list[int],
        params: PoolingParams,
        priority: int,
        arrival_time: float | None,
    ) -> None:
        """Queue an embedding request: its prompt is computed once and pooled."""
        if request_id in self.groups:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            prompt = text_head(prompt, params.truncate_prompt_tokens, self.pooler.max_tokens)
        ids = embedding_input(self.encode_prompt(prompt), params, self.pooler, self._end_token)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=_POOLING_SAMPLING,
            priority=priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            pooling=params,
        )
        text = prompt if isinstance(prompt, str) else None
        self.groups[request_id] = RequestGroup(request_id, text, ids, [req], [0])
        self._seqs[request_id] = req
        self.scheduler.add(req)

    def _check_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> list[int]:
        """The prompt's token ids, once the request is known to be one this engine can
        run (else a RequestError naming the field)."""
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params", "sampling_params must be a SamplingParams")
        if request_id in self.groups:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise RequestError(
                "logit_bias", f"logit_bias token id {bad[0]} is out of range [0, {vocab})"
            )
        ids = self.encode_prompt(prompt)
        if not ids:
            raise RequestError("prompt", "prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                "prompt",
                f"the prompt has {len(ids)} tokens but this model's context is "
                f"{self.max_model_len} tokens (prompt and output together)",
            )
        return ids

    def abort_request(self, request_id: str) -> bool:
        """Abort a request and free its blocks. Returns False if it was not known."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            if not seq.is_finished:
                self._retire(seq, RequestStatus.FINISHED_ABORTED)
            self._seqs.pop(seq.request_id, None)
        self._save_kv()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- one step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self._release_drafts(sched.preempted)
        if not sched:
            if self.kv_connector is not None and self.scheduler.waiting:
                # Requests wait for KV on its way (a decode instance's pulls): sleep
                # until some arrives rather than spin against the threads moving it.
                self.kv_connector.scheduler.wait_for_arrivals(0.01)
            return []
        try:
            outputs = self._run_step(sched)
        except BaseException:
            self._undo_step(sched)
            raise
        # Only now is this step's KV known to be written (on CUDA the kernels run
        # asynchronously, and a failure surfaces at the first sync, in sampling).
        self.kv.commit_names()
        self._save_kv()
        return outputs

    def _save_kv(self) -> None:
        """Hand the blocks of requests that just finished to the KV connector, before
        anything can write the pool again (their blocks are free now)."""
        if self.kv_connector is not None:
            self.kv_connector.worker.save(self.kv_connector.scheduler.take_saves())

    def wait_for_kv_saves(self) -> None:
        """Block until the KV connector has stored every block handed to it."""
        if self.kv_connector is not None:
            self.kv_connector.worker.wait_for_saves()

    def close(self) -> None:
        """Finish the KV connector's saves in flight; the engine goes on without it."""
        self.attach_kv_connector(None)

    def attach_kv_connector(self, connector: KVConnector | None) -> None:
        """Replace the KV connector (the old one finishes its saves first), e.g. a disk
        tier on another directory; None: none. Call between steps."""
        if connector is not None and self.kv.local_pool is not None:
            # A connector's block bytes are one pool's; the split cache has two.
            raise ValueError(
                "connector: KV connectors need a single KV pool; this engine splits its "
                "pool for the windowed layers (construct it with split_kv_pool=False)"
            )
        if self.kv_connector is not None:
            self._save_kv()
            self.kv_connector.close()
        self.kv_connector = connector
        self.scheduler.connector = connector.scheduler if connector else None

    def _undo_step(self, sched: SchedulerOutput) -> None:
        """A step raised: it may have written all, some or none of its KV. The blocks it
        named leave the prefix cache, and the requests it scheduled go back to be
        recomputed, so nothing reads what it left. The caller may abort them or step again."""
        self.kv.forget_uncommitted_names()
        if self.kv_connector is not None:
            self.kv_connector.step_failed()
        self.scheduler.requeue([req for req, _ in sched.scheduled])
        self._release_drafts([req for req, _ in sched.scheduled])

    def _run_step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        if sched.kv_loads:
            assert self.kv_connector is not None
            self.kv_connector.worker.load(sched.kv_loads)
        self.runner.copy_blocks(sched.blocks_to_copy)
        self.runner.copy_blocks(sched.local_blocks_to_copy, LOCAL_KV_GROUP)
        result = self.runner.execute(sched.scheduled)
        if self.speculator is not None and result.features is not None:
            self.speculator.take_features(sched.scheduled, result.features)
        for req, n in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            req.num_computed_tokens += n
        self._track_waste()
        for req_id, (start, logits) in result.prompt_logits.items():
            add_prompt_logprobs(self._seqs[req_id], start, logits)
        touched = self._finish_pooled(result.pooled)
        if not result.sampling_requests:
            self.num_steps += 1
            return [self._make_output(g) for g in touched.values()]

        seqs, rows, logits = self._sampling_rows(result)
        stop_ids = [self._stop_token_ids(r.sampling_params) for r in rows]
        sampled = self.sampler(logits, rows, stop_ids, self.constraint_masks(rows))

        finished_at = time.monotonic()
        num_emitted = 0
        for req, first, count in seqs:
            if req.pending_forks:
                for child in req.pending_forks:
                    self.kv.fork(req, child)
                    self.scheduler.add_running(child)
                req.pending_forks = []
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = finished_at
            tokens = sampled.token_ids[first : first + count]
            drafts = req.spec_token_ids
            accepted = accepted_length(tokens, drafts) if drafts else 0
            logprobs = sampled.logprobs[first : first + accepted + 1]
            emitted = self._emit(req, tokens[: accepted + 1], logprobs, finished_at)
            num_emitted += emitted
            if req.lora is not None:
                name = req.lora.name
                self.lora_tokens[name] = self.lora_tokens.get(name, 0) + emitted
            if drafts:
                self._end_verification(req, len(drafts), accepted, emitted)
            touched[req.group_id] = self.groups[req.group_id]
        self.num_steps += 1
        self.num_generated_tokens += num_emitted
        return [self._make_output(g) for g in touched.values()]

    def _finish_pooled(self, pooled: dict[str, torch.Tensor]) -> dict[str, RequestGroup]:
        """Embedding requests whose prompt is complete get their vector and end."""
        touched: dict[str, RequestGroup] = {}
        for req_id, vector in pooled.items():
            req = self._seqs[req_id]
            assert req.pooling is not None
            req.embedding = finish_vector(vector, req.pooling, self.pooler)
            req.metrics.first_token_time = req.metrics.finished_time = time.monotonic()
            self._retire(req, RequestStatus.FINISHED_STOPPED)
            touched[req.group_id] = self.groups[req.group_id]
        return touched

    def _sampling_rows(
        self, result: ModelOutput
    ) -> tuple[list[tuple[Request, int, int]], list[SamplingRow], torch.Tensor]:
        """The sampler's rows: for each request that samples, and each fork waiting on
        it (sampling from the same logits), its own row and one row per draft token it
        verifies. Also (request, its first row, its number of rows) and the logits in
        row order."""
        seqs: list[tuple[Request, int, int]] = []
        rows: list[SamplingRow] = []
        src: list[int] = []
        first = 0
        for req, count in zip(result.sampling_requests, result.num_rows, strict=True):
            for r in (req, *req.pending_forks):
                seqs.append((r, len(rows), count))
                rows.append(r)
                rows.extend(DraftRow(r, r.spec_token_ids[:j]) for j in range(1, count))
                src.extend(range(first, first + count))
            first += count
        logits = result.logits
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(src, device=logits.device)]
        return seqs, rows, logits

    def _emit(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[SampledLogprob | None],
        now: float,
    ) -> int:
        """Append sampled tokens in order until one finishes the sequence, then any
        tokens its grammar forces; how many sampled tokens went in."""
        for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            if lp is not None and req.logprobs is not None:
                add_logprobs(req, tok, lp, self.tokenizer)
            if self._append(req, tok, now):
                return i + 1
        # Tokens the grammar forces go in without a step each: the scheduler computes
        # them next step as one short chunk.
        forced = forced_tokens(req)
        for i, tok_f in enumerate(forced):
            self.num_forced_tokens += 1
            # The matcher has all of them already: it is complete, if at all, only
            # after the last.
            last = i == len(forced) - 1
            if self._append(req, tok_f, now, consumed=True, last=last):
                break
        return len(tokens)

    def _end_verification(
        self, req: Request, num_drafts: int, num_accepted: int, num_emitted: int
    ) -> None:
        """After a request verified its drafts: the speculator and the request's metrics
        learn how many were accepted, and the KV of the rejected ones is rolled back (a
        finished request has freed its blocks already)."""
        assert self.speculator is not None
        self.speculator.observe(req, num_drafts, num_accepted, num_emitted)
        req.metrics.spec_drafted_tokens += num_drafts
        req.metrics.spec_accepted_tokens += num_accepted
        req.spec_token_ids = []
        if not req.is_finished:
            self.kv.rollback(req, num_drafts - num_accepted)

    def _append(
        self, req: Request, tok: int, now: float, consumed: bool = False, last: bool = True
    ) -> bool:
        """Add one output token and apply the stop rules (and the grammar's end); True
        if the sequence finished. consumed: the grammar's matcher has the token already
        (a forced token; last: the last of them)."""
        req.append_token(tok)
        assert req.output is not None
        params = req.sampling_params
        max_tokens = min(
            params.max_tokens if params.max_tokens is not None else self.max_model_len,
            self.max_model_len - req.num_prompt_tokens,
        )
        complete = advance(req, tok, consumed) and last
        if not (req.output.append(tok, max_tokens) or (complete and req.output.finish_complete())):
            return False
        status = (
            RequestStatus.FINISHED_LENGTH
            if req.output.finish_reason == "length"
            else RequestStatus.FINISHED_STOPPED
        )
        req.metrics.finished_time = now
        self._retire(req, status)
        return True

    def _retire(self, req: Request, status: RequestStatus) -> None:
        """The one way a sequence ends (finished or aborted): the scheduler frees it,
        and the speculator hears of it (the suffix proposer keeps its tokens)."""
        self.scheduler.finish(req, status)
        if self.speculator is not None:
            self.speculator.finish(req)

    # ---- helpers -------------------------------------------------------------------

    def _release_drafts(self, requests: list[Request]) -> None:
        """Requests whose KV was dropped to be recomputed (preempted, requeued) drop
        their proposer state too: a draft model's blocks go back to its pool."""
        if self.speculator is not None:
            for req in requests:
                self.speculator.release(req)

    def _stop_token_ids(self, p: SamplingParams) -> list[int]:
        ids = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            ids.extend(self.tokenizer.eos_token_ids)
        return ids

    def _track_waste(self) -> None:
        for req in self.scheduler.running:
            held, used = self.kv.slot_usage(req)  # blocks a window released are neither
            self.waste.allocated_slots += held
            self.waste.used_slots += used

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        out = make_output(group)
        if out.finished:
            if self.kv_connector is not None:
                leader = group.seqs[0].request_id
                out.kv_transfer_params = self.kv_connector.scheduler.take_transfer_params(leader)
            del self.groups[group.request_id]
            for s in group.seqs:
                self._seqs.pop(s.request_id, None)
        return out

    # ---- introspection ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """/stats' JSON: EngineStats as a dict. Each stat's meaning, merge across
        replicas and Prometheus export are declared on its field (sluice/engine/stats.py,
        which imports nothing of the engine)."""
        pool, local = self.kv.pool, self.kv.local_pool
        spec, draft = self.speculator, self.draft
        drafted = spec.num_drafted_tokens if spec else 0
        accepted = spec.num_accepted_tokens if spec else 0
        emitted = spec.num_emitted_tokens if spec else 0
        steps = spec.num_verify_steps if spec else 0
        lora = getattr(self.runner, "lora", None)  # the slots (a decoder with LoRA on)
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_requests=len(self.groups),
            kv_total_blocks=pool.num_blocks,
            kv_free_blocks=pool.num_free,
            kv_local_total_blocks=local.num_blocks if local else 0,
            kv_local_free_blocks=local.num_free if local else 0,
            kv_usage=self.kv.usage,
            kv_waste=self.waste.fraction,
            prefix_cache_hit_rate=self.kv.prefix_cache_hit_rate,
            prefix_cache_queried_tokens=self.kv.num_queried_tokens,
            prefix_cache_hit_tokens=self.kv.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_forced_tokens=self.num_forced_tokens,
            spec_method=self.config.speculative_method,
            spec_drafted_tokens=drafted,
            spec_accepted_tokens=accepted,
            spec_emitted_tokens=emitted,
            spec_verify_steps=steps,
            spec_acceptance_rate=ratio(accepted, drafted),
            spec_mean_accepted_length=ratio(emitted, steps),
            spec_draft_kv_total_blocks=draft.kv.pool.num_blocks if draft else 0,
            spec_draft_kv_free_blocks=draft.kv.num_free_blocks if draft else 0,
            spec_draft_forwards=draft.num_forwards if draft else 0,
            connector=self.kv_connector.stats() if self.kv_connector else None,
            grammars_compiled=self.grammars.num_compiled,
            moe_expert_tokens=self.runner.expert_tokens(),
            lora_loaded_slots=lora.num_loaded if lora else 0,
            lora_slot_loads=lora.loads if lora else 0,
            lora_requests=dict(self.lora_requests),
            lora_generated_tokens=dict(self.lora_tokens),
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            cpu_kernels=self.cpu_kernels,
            weight_bytes=self.weight_bytes,
        ).as_dict()

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()
