"""Engine behaviour at the edges, on the real model: aborting a half-done chunked
prefill, the context limit, multi-byte text, stop strings across tokens, and n > 1
with the prefix cache and preemption together."""

from __future__ import annotations

import pytest

from sluice import LLM, SamplingParams
from sluice.engine.engine import LLMEngine, RequestError
from sluice.outputs import RequestOutput

TEXT = (
    "The river rose through the night, and by morning the lower streets of the town were "
    "under water. Boats moved between the houses, carrying bread, lamps and the old "
    "people who had refused to leave, while on the hill the bells rang every hour. "
    "Nobody could remember a flood like it, not even the miller, who was ninety and had "
    "seen the bridge go twice."
)
PER_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # bytes of one fp32 KV block of the bundled model
CONTEXT = 64


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


@pytest.fixture(scope="module")
def small() -> LLM:
    """8 blocks of 16 tokens, a 64-token context and 32-token steps: prefills are
    chunked, three 54-token sequences do not fit at once, and the limit is cheap to reach."""
    return LLM(
        dtype="float32",
        kv_cache_memory=8 * PER_BLOCK / 2**30,
        max_model_len=CONTEXT,
        max_num_batched_tokens=32,
    )


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests"] == stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def stream(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[list[str], RequestOutput]:
    """Run one request alone, step by step; its streamed deltas and its final output."""
    engine.add_request("streamed", prompt, params)
    deltas: list[str] = []
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            last = out
    assert last is not None and last.finished
    return deltas, last


def test_abort_during_chunked_prefill(small: LLM) -> None:
    eng = small.engine
    tok = small.tokenizer
    long_prompt = tok.encode(TEXT)[:60]
    short_prompt = tok.encode("The capital of France is")
    (short_alone,) = small.generate(short_prompt, greedy(12), use_tqdm=False)
    (long_alone,) = small.generate(long_prompt, greedy(2), use_tqdm=False)
    eng.reset_prefix_cache()

    eng.add_request("short", short_prompt, greedy(12))
    eng.add_request("long", long_prompt, greedy(2))
    eng.step()  # the short prompt, and the first chunk of the long one
    long_req = eng.groups["long"].seqs[0]
    assert 16 <= long_req.num_computed_tokens < len(long_prompt)  # half prefilled
    long_blocks = list(long_req.block_ids)
    assert eng.abort_request("long")
    assert all(eng.kv.pool.ref_counts[b] == 0 for b in long_blocks)
    assert eng.scheduler.running == [eng.groups["short"].seqs[0]]

    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["short"]
    assert done[0].outputs[0].token_ids == short_alone.outputs[0].token_ids
    assert_all_free(small)
    # The chunk it did compute stays cached, and is right: the prompt sent again hits it.
    (again,) = small.generate(long_prompt, greedy(2), use_tqdm=False)
    assert again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == long_alone.outputs[0].token_ids
    assert_all_free(small)


def test_context_limit_counts_prompt_and_output(small: LLM, llm_fp32: LLM) -> None:
    eng = small.engine
    assert eng.max_model_len == CONTEXT
    ids = small.tokenizer.encode(TEXT)
    # A prompt must leave room for one output token: exactly the context is refused...
    with pytest.raises(RequestError, match="context") as e:
        small.generate(ids[:CONTEXT], greedy(1), use_tqdm=False)
    assert e.value.param == "prompt"
    assert_all_free(small)
    # ...one token less is taken, and gets exactly one token whatever max_tokens says.
    forever = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    (edge,) = small.generate(ids[: CONTEXT - 1], forever, use_tqdm=False)
    assert len(edge.outputs[0].token_ids) == 1
    assert edge.outputs[0].finish_reason == "length"
    # Output stops at the context, as "length", with or without a max_tokens past it,
    # and is what an engine with a larger context gives for those tokens.
    for params in (forever, forever.clone(max_tokens=None)):
        (out,) = small.generate(ids[:50], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == CONTEXT - 50
        assert out.outputs[0].finish_reason == "length"
    (wide,) = llm_fp32.generate(ids[:50], forever.clone(max_tokens=CONTEXT - 50), use_tqdm=False)
    assert out.outputs[0].token_ids == wide.outputs[0].token_ids
    assert_all_free(small)


def test_multibyte_text_streams_whole_characters(llm_fp32: LLM) -> None:
    eng = llm_fp32.engine
    tok = llm_fp32.tokenizer
    # Greedy continues with emoji: 4 bytes each, spread over byte-level tokens.
    prompt = tok.encode("Emoji list: 😀 😃 😄 😁 😆 😅 😂 🤣")
    deltas, out = stream(eng, prompt, SamplingParams(temperature=0, max_tokens=24))
    ids = out.outputs[0].token_ids
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= len(ids) // 2  # split characters
    assert "".join(deltas) == out.outputs[0].text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # held back while a character was incomplete
    assert len(out.outputs[0].text.encode()) > len(out.outputs[0].text)  # multi-byte indeed

    # Cut off mid-character by max_tokens: the bytes so far are flushed at the end, as a
    # full decode shows them, and nowhere before.
    prompt = tok.encode("日本語のテキスト: こんにちは、世界。今日は")
    deltas, out = stream(eng, prompt, SamplingParams(temperature=0, max_tokens=24))
    text = out.outputs[0].text
    assert text.endswith("\ufffd") and text.count("\ufffd") == 1
    assert "".join(deltas) == text == tok.decode(out.outputs[0].token_ids)
    assert "\ufffd" in deltas[-1] and not any("\ufffd" in d for d in deltas[:-1])
    assert_all_free(llm_fp32)


def test_stop_string_across_tokens(llm_fp32: LLM) -> None:
    eng = llm_fp32.engine
    prompt = llm_fp32.tokenizer.encode("def fibonacci(n):")
    # The text after each token of the unstopped greedy output.
    eng.add_request("full", prompt, greedy(32))
    texts: list[str] = []
    ids: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            texts.append(o.outputs[0].text)
            ids = o.outputs[0].token_ids
    # A stop string made of the last two characters of one token and the first two of
    # the next: it only exists across the boundary.
    j = next(
        j
        for j in range(1, len(texts) - 1)
        if len(texts[j]) - len(texts[j - 1]) >= 2 and len(texts[j + 1]) - len(texts[j]) >= 2
    )
    cut = len(texts[j]) - 2
    stop = texts[j + 1][cut : cut + 4]
    assert texts[-1].find(stop) == cut  # its first occurrence

    deltas, out = stream(eng, prompt, greedy(32).clone(min_tokens=0, stop=[stop]))
    c = out.outputs[0]
    assert c.text == texts[-1][:cut]  # cut exactly before the stop string
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == ids[: j + 2]  # ended by the token that completed it
    assert "".join(deltas) == c.text  # no part of it was streamed
    assert_all_free(llm_fp32)


def test_n_with_prefix_cache_and_preemption(small: LLM) -> None:
    eng = small.engine
    prompt = small.tokenizer.encode(TEXT)[:30]
    # top_k: over the whole vocabulary, a draw can land between tail tokens whose
    # probability intervals are narrower than the ~1e-6 by which fp32 logits differ
    # between a prefix hit, a recompute and a full prefill; 40 candidates are far apart.
    sp = SamplingParams(temperature=1.0, top_k=40, max_tokens=24, ignore_eos=True, seed=11, n=3)
    # Each sample alone, seeded seed + i: what the n > 1 request must reproduce.
    alone = [
        small.generate(prompt, sp.clone(n=1, seed=11 + i), use_tqdm=False)[0].outputs[0]
        for i in range(3)
    ]
    eng.reset_prefix_cache()
    small.generate(prompt, greedy(1), use_tqdm=False)  # leaves the prompt's full block cached
    preemptions = eng.scheduler.num_preemptions

    (out,) = small.generate(prompt, sp, use_tqdm=False)
    assert out.num_cached_tokens == 16
    # Three 54-token sequences need 10 blocks of the 8: some are preempted and recomputed.
    assert eng.scheduler.num_preemptions > preemptions
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert [c.text for c in out.outputs] == [a.text for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert_all_free(small)
