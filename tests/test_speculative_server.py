"""Speculative decoding through the OpenAI API: a `sluice serve --speculative-method
suffix` process streams several tokens a step, and what it streams is what it answers
unstreamed (text, finish reason, usage); /metrics counts the drafts.

Each request is sent unstreamed first: that puts it in the suffix store, so the streamed
copy drafts it whole and most of its steps carry several tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serving import Server, serve, wait_idle

MODEL = "smollm2-135m"
PROMPT = (
    "apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum. " * 3 + "apple, banana,"
)
SPEC = "sluice_spec_decode_"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serve(
        "--dtype",
        "float32",
        "--speculative-method",
        "suffix",
        "--num-speculative-tokens",
        "4",
        # A flat cost instead of the table measured at start-up: every batch speculates.
        "--speculative-draft-cost",
        "0.05",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "0.25",
    ) as srv:
        yield srv


def test_a_streamed_completion_carries_several_tokens_a_chunk(server: Server) -> None:
    client = server.client()
    kw = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 40, "logprobs": 0}
    whole = client.completions.create(**kw)
    before = server.metrics()
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == whole.choices[0].text
    assert [c.finish_reason for c in choices if c.finish_reason] == [whole.choices[0].finish_reason]
    # One chunk a step: its logprobs list the step's tokens.
    per_chunk = [len(c.logprobs.tokens) for c in choices if c.logprobs is not None]
    assert whole.usage is not None and chunks[-1].usage is not None
    assert sum(per_chunk) == chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert max(per_chunk) > 1 and len(per_chunk) < sum(per_chunk) // 2
    after = server.metrics()
    for name in ("num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "num_drafts"):
        assert after[SPEC + name] > before[SPEC + name]
    assert after[SPEC + "mean_accepted_length"] > 1.0
    assert 0 < after[SPEC + "acceptance_rate"] <= 1
    # Nothing left running or holding KV blocks (drafts rolled back, streams finished).
    stats = wait_idle(server)
    assert stats["num_requests"] == 0 and stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_a_streamed_chat_equals_the_whole_answer(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Repeat this list twice: " + PROMPT}]
    kw = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 48}
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(  # type: ignore[call-overload]
            **kw, stream=True, stream_options={"include_usage": True}
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.delta.content or "" for c in choices) == whole.choices[0].message.content
    assert [c.finish_reason for c in choices if c.finish_reason] == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # Fewer content chunks than tokens: some steps streamed several.
    assert len([c for c in choices if c.delta.content]) < whole.usage.completion_tokens
    stats = wait_idle(server)
    assert stats["spec_method"] == "suffix" and stats["spec_accepted_tokens"] > 0
