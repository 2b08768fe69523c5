"""A user's request as the engine tracks it (a group of n sequences) and the
RequestOutput each step hands back: new text and tokens, logprobs, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance
import torch

from sluice.core.request import Request
from sluice.engine.output import SequenceOutputState
from sluice.loader import Tokenizer
from sluice.outputs import CompletionOutput, Logprob, RequestMetricsOut, RequestOutput
from sluice.sampling_params import SamplingParams

# A sampled token's logprob, its rank, and the top alternatives' ids and logprobs.
SampledLogprob = tuple[float, int, list[int], list[float]]


@dataclass
class RequestGroup:
    """The user's request: one prompt and its n output sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    # Per sequence, how many of its tokens earlier outputs carried (for the deltas).
    sent_tokens: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def new_group(
    request_id: str,
    prompt: str | list[int],
    ids: list[int],
    params: SamplingParams,
    tokenizer: Tokenizer,
    grammar: llguidance.LLMatcher | None,
    priority: int,
    arrival: float,
) -> RequestGroup:
    """A checked request's n sequences, each with its output state, its own copy of the
    grammar and its logprob list where asked. The first computes the prompt; the others
    fork from it (sharing its blocks, copy-on-write) when its first token is sampled."""
    seqs = []
    for i in range(params.n):
        seq = Request(
            request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            group_id=request_id,
            index=i,
            priority=priority,
            arrival_time=arrival,
            # n > 1 with a seed: sample i uses seed + i, so it equals a separate
            # request seeded that way.
            seed=None if params.seed is None else params.seed + i,
        )
        seq.output = SequenceOutputState(tokenizer, ids, params)
        if grammar is not None:
            seq.grammar = grammar.deep_copy()
        if params.logprobs is not None:
            seq.logprobs = []
        seqs.append(seq)
    seqs[0].pending_forks = seqs[1:]
    text = prompt if isinstance(prompt, str) else None
    return RequestGroup(request_id, text, ids, seqs, [0] * params.n)


def make_output(group: RequestGroup) -> RequestOutput:
    """The group's output now: each sequence's text so far and what is new since the
    last output (an embedding request's: its vector, once finished)."""
    leader = group.seqs[0]
    if leader.pooling is not None:
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=[],
            finished=group.finished,
            metrics=_metrics(group),
            embedding=leader.embedding,
        )
    outs = []
    for i, seq in enumerate(group.seqs):
        st = seq.output
        assert st is not None
        new_ids = st.token_ids[group.sent_tokens[i] :]
        group.sent_tokens[i] = len(st.token_ids)
        outs.append(
            CompletionOutput(
                index=i,
                text=st.text,
                token_ids=list(st.token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                # A copy: the engine keeps appending to its own list (another thread
                # may be reading this output).
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=st.finish_reason if seq.is_finished else None,
                stop_reason=st.stop_reason,
                delta_text=st.take_delta(),
                delta_token_ids=new_ids,
            )
        )
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=outs,
        finished=group.finished,
        num_cached_tokens=max(leader.num_cached_tokens, 0),
        prompt_logprobs=leader.prompt_logprobs,
        metrics=_metrics(group),
    )


def _metrics(group: RequestGroup) -> RequestMetricsOut:
    m = group.seqs[0].metrics
    finished = group.finished
    return RequestMetricsOut(
        m.arrival_time,
        m.first_scheduled_time,
        m.first_token_time,
        max((s.metrics.finished_time or 0.0) for s in group.seqs) if finished else None,
        spec_drafted_tokens=sum(s.metrics.spec_drafted_tokens for s in group.seqs),
        spec_accepted_tokens=sum(s.metrics.spec_accepted_tokens for s in group.seqs),
    )


def add_logprobs(req: Request, tok: int, lp: SampledLogprob, tokenizer: Tokenizer) -> None:
    """Record a sampled token's logprob and its top alternatives on the sequence."""
    value, rank, top_ids, top_vals = lp
    entry = {tok: Logprob(value, rank, tokenizer.decode([tok], skip_special_tokens=False))}
    for i, (tid, tv) in enumerate(zip(top_ids, top_vals, strict=True)):
        if tid not in entry:
            entry[tid] = Logprob(tv, i + 1, tokenizer.decode([tid], skip_special_tokens=False))
    assert req.logprobs is not None
    req.logprobs.append(entry)
    req.cumulative_logprob += value


def add_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
    """Logits at positions start.. predict prompt tokens start+1..; position 0 has none."""
    n_top = req.sampling_params.prompt_logprobs or 0
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None]
    # After a preemption the prompt is recomputed: skip positions already recorded.
    skip = len(req.prompt_logprobs) - 1 - start
    prompt = req.prompt_token_ids
    count = min(logits.shape[0], len(prompt) - 1 - start)
    if count <= skip:
        return
    logprobs = torch.log_softmax(logits[skip:count], dim=-1)
    start, count = start + skip, count - skip
    targets = torch.tensor(prompt[start + 1 : start + 1 + count])
    chosen = logprobs[torch.arange(count), targets]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    top_vals, top_ids = logprobs.topk(n_top) if n_top else (None, None)
    for j in range(count):
        t = int(targets[j])
        entry = {t: Logprob(float(chosen[j]), int(ranks[j]))}
        if top_ids is not None and top_vals is not None:
            for r, (tid, tv) in enumerate(
                zip(top_ids[j].tolist(), top_vals[j].tolist(), strict=True)
            ):
                entry.setdefault(tid, Logprob(tv, r + 1))
        req.prompt_logprobs.append(entry)
