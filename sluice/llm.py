"""The public Python API: LLM(...).generate(...) and .chat(...)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from sluice.config import EngineConfig
from sluice.core.lora import LoRARequest
from sluice.core.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from sluice.core.pooling_params import PoolingParams
from sluice.core.sampling_params import SamplingParams
from sluice.engine.engine import LLMEngine
from sluice.engine.pooling import text_head

Message = dict[str, str]


def _prompt_list(
    prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
) -> list[str | list[int]]:
    """One prompt (a string or a list of token ids) or several, as a list."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [cast("str | list[int]", prompts)]
    return list(cast("Sequence[str | list[int]]", prompts))


def _per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One adapter (or none) for every prompt, or one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts")
    return loras


class LLM:
    """An engine in this process. `LLM(model=None, **engine_options)`; the options are
    the fields of EngineConfig (dtype, block_size, max_model_len, max_num_seqs,
    max_num_batched_tokens, kv_cache_memory, seed, enable_prefix_caching, ...)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = LLMEngine.from_config(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        if self.engine.tp_workers is not None:
            # Tensor-parallel workers stop with this object (or at exit at the latest).
            weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); a no-op without."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs keep the
        order of the prompts. lora_request: the LoRA adapter to run them through (one
        for all, or one per prompt, None for the base model; needs enable_lora=True)."""
        prompt_list = _prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompt_list))
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")

        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(
                    rid,
                    prompt,
                    params,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i],
                )
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            for rid in ids:  # leave the engine clean if a prompt was bad or we were interrupted
                self.engine.abort_request(rid)
            raise

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        convs: list[list[Message]]
        if messages and isinstance(messages[0], dict):
            convs = [messages]  # one conversation
        else:
            convs = cast(list[list[Message]], messages)
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, **template_kwargs
                ),
                add_special_tokens=False,
            )
            for conv in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The vector of each input (a string or token ids), in order, from an embedding
        model (`out.outputs.embedding`); the engine batches them as it batches prompts."""
        params = pooling_params or PoolingParams()
        prompt_list = self._tokenized(_prompt_list(prompts), params)
        ids = []
        try:
            for prompt in prompt_list:
                rid = f"embd-{next(self._ids)}"
                self.engine.add_request(rid, prompt, params)
                ids.append(rid)
            outputs = self._run(ids, use_tqdm, "embedding")
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding))
            for o in outputs
            if o.embedding is not None
        ]

    def _tokenized(
        self, prompts: list[str | list[int]], params: PoolingParams
    ) -> list[str | list[int]]:
        """The texts among `prompts` tokenized together (the backend runs them in
        parallel), each only as far as the request reads it."""
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str) and p]
        if not texts:
            return prompts
        limit, truncate = self.engine.pooler.max_tokens, params.truncate_prompt_tokens
        heads = [text_head(cast(str, prompts[i]), truncate, limit) for i in texts]
        out = list(prompts)
        for i, ids in zip(texts, self.tokenizer.encode_batch(heads), strict=True):
            out[i] = ids
        return out

    def _run(self, ids: list[str], use_tqdm: bool, what: str = "generating") -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc=what, unit="req", disable=not use_tqdm or len(ids) < 2)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()
