"""End-to-end generation on the real SmolLM2-135M model, checked against transformers."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.engine.engine import RequestError
from tests.conftest import PROMPTS

# min_tokens suppresses EOS exactly like transformers' min_new_tokens.
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests"] == 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_greedy_matches_transformers_one_at_a_time(
    llm_fp32: LLM, hf_greedy: dict[str, list[int]]
) -> None:
    for p in PROMPTS:
        (out,) = llm_fp32.generate(p, GREEDY_32, use_tqdm=False)
        assert out.outputs[0].token_ids == hf_greedy[p], p
        assert out.outputs[0].finish_reason == "length"
    assert_all_free(llm_fp32)


def test_greedy_matches_transformers_in_a_mixed_batch(
    llm_fp32: LLM, hf_greedy: dict[str, list[int]]
) -> None:
    prompts = PROMPTS * 2  # duplicates share blocks through the prefix cache too
    outs = llm_fp32.generate(prompts, GREEDY_32, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy[p], p
    assert_all_free(llm_fp32)


def test_greedy_matches_with_tiny_prefill_chunks(hf_greedy: dict[str, list[int]]) -> None:
    llm = LLM(dtype="float32", kv_cache_memory=0.05, max_num_batched_tokens=5)
    outs = llm.generate(PROMPTS, GREEDY_32, use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy[p], p
    assert_all_free(llm)


def test_greedy_matches_under_preemption(hf_greedy: dict[str, list[int]]) -> None:
    # 12 blocks of 16 tokens cannot hold five ~45-token sequences at once.
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    llm = LLM(dtype="float32", kv_cache_memory=12 * per_block / 2**30, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY_32, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy[p], p
    assert_all_free(llm)


def test_seeded_sampling_is_independent_of_the_batch(llm_fp32: LLM) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234)
    (alone,) = llm_fp32.generate(PROMPTS[2], sp, use_tqdm=False)
    others = SamplingParams(temperature=1.0, max_tokens=30)
    batch = llm_fp32.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1]], [others, sp, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    # And a different seed gives a different text.
    (other,) = llm_fp32.generate(PROMPTS[2], sp.clone(seed=99), use_tqdm=False)
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_samples_equal_separately_seeded_requests(llm_fp32: LLM) -> None:
    sp = SamplingParams(temperature=1.0, max_tokens=20, seed=7, n=3)
    (out,) = llm_fp32.generate(PROMPTS[2], sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = llm_fp32.generate(
        [PROMPTS[2]] * 3, [sp.clone(n=1, seed=7 + i) for i in range(3)], use_tqdm=False
    )
    for i in range(3):
        assert out.outputs[i].token_ids == singles[i].outputs[0].token_ids
        assert out.outputs[i].text == singles[i].outputs[0].text
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_all_free(llm_fp32)


def test_stop_string_truncates_text(llm_fp32: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    (full,) = llm_fp32.generate(PROMPTS[1], greedy, use_tqdm=False)
    text = full.outputs[0].text
    stop = "return"
    assert stop in text
    (cut,) = llm_fp32.generate(PROMPTS[1], greedy.clone(min_tokens=0, stop=[stop]), use_tqdm=False)
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].stop_reason == stop


def test_min_tokens_and_eos(llm_fp32: LLM) -> None:
    # Greedy on this prompt ends with EOS well before 32 tokens...
    (short,) = llm_fp32.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False
    )
    assert short.outputs[0].finish_reason == "stop"
    n = len(short.outputs[0].token_ids)
    assert n < 40
    # ...and min_tokens holds it off.
    (longer,) = llm_fp32.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 5), use_tqdm=False
    )
    assert len(longer.outputs[0].token_ids) >= n + 5


def test_logprobs_are_consistent(llm_fp32: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    (out,) = llm_fp32.generate(PROMPTS[3], sp, use_tqdm=False)
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    total = 0.0
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 5 <= len(entry) <= 6
        assert sum(math.exp(lp.logprob) for lp in entry.values()) <= 1.0 + 1e-4
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_match_transformers(llm_fp32: LLM, hf_smollm2: tuple[Any, Any]) -> None:
    model, _ = hf_smollm2
    (out,) = llm_fp32.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry is not None
        assert entry[ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-3)


def test_bad_prompts_raise_errors_naming_the_field(llm_fp32: LLM) -> None:
    with pytest.raises(RequestError, match="prompt") as e:
        llm_fp32.generate("", use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="out of range"):
        llm_fp32.generate([[1, 2, 10**9]], use_tqdm=False)
    with pytest.raises(RequestError, match="context"):
        llm_fp32.generate([[1] * (llm_fp32.engine.max_model_len + 1)], use_tqdm=False)
    assert_all_free(llm_fp32)


def test_abort_frees_blocks(llm_fp32: LLM) -> None:
    eng = llm_fp32.engine
    eng.add_request("to-abort", PROMPTS[2], SamplingParams(max_tokens=50, n=2))
    for _ in range(4):
        eng.step()
    assert eng.stats()["kv_free_blocks"] < eng.stats()["kv_total_blocks"]
    assert eng.abort_request("to-abort")
    assert not eng.abort_request("to-abort")
    assert_all_free(llm_fp32)


def test_chat_uses_the_template(llm_fp32: LLM) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    (out,) = llm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    expected = llm_fp32.tokenizer.encode(
        llm_fp32.tokenizer.apply_chat_template(messages), add_special_tokens=False
    )
    assert out.prompt_token_ids == expected
    assert "4" in out.outputs[0].text


def test_logit_bias_steers_and_is_validated(llm_fp32: LLM) -> None:
    target = llm_fp32.tokenizer.encode(" banana")[0]
    sp = SamplingParams(temperature=0, max_tokens=3, logit_bias={target: 100.0})
    (out,) = llm_fp32.generate(PROMPTS[0], sp, use_tqdm=False)
    assert out.outputs[0].token_ids == [target] * 3
    with pytest.raises(RequestError) as e:
        llm_fp32.generate(PROMPTS[0], sp.clone(logit_bias={10**7: 1.0}), use_tqdm=False)
    assert e.value.param == "logit_bias"
    assert_all_free(llm_fp32)


def test_repetition_penalty_matches_transformers(
    llm_fp32: LLM, hf_smollm2: tuple[Any, Any]
) -> None:
    model, _ = hf_smollm2
    sp = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, repetition_penalty=1.3)
    (out,) = llm_fp32.generate(PROMPTS[1], sp, use_tqdm=False)
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.3,
        )[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids == ref
