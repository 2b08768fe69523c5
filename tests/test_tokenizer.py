"""Tokenizer: equal to transformers on SmolLM2, and to llama.cpp's reference tokenizations;
untrusted text and ids (hypothesis) round-trip or end in a ValueError naming the defect,
and message text reaches the prompt verbatim through the chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from sluice import settings
from sluice.loader import Tokenizer, load_model, tokenizer_from_gguf

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\tindented\twith tabs\n\n\n    and   multiple    spaces   ",
    "12345678 and 3.14159 and -42 and 1,000,000",
    "Emojis 🦙🚀👍🏽 and CJK 你好，世界 日本語のテキスト 한국어",
    "  leading spaces, trailing newline\n",
    "\n\n\n",
    "",
    " ",
    "Ünïcödé àccents — “quotes” …",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|endoftext|>special <|im_end|>tokens",
    "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n",
    "I'm sure they'll've done it; we'd've known. DON'T SHOUT!",
]

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
]


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return load_model(str(smollm2_path)).tokenizer


def test_encode_matches_transformers(tok: Tokenizer, hf_smollm2: tuple[Any, Any]) -> None:
    hf_tok = hf_smollm2[1]
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=True), text
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(
            text, add_special_tokens=False
        ), text


def test_chat_template_matches_transformers(tok: Tokenizer, hf_smollm2: tuple[Any, Any]) -> None:
    hf_tok = hf_smollm2[1]
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        ours = tok.apply_chat_template(messages, add_generation_prompt=True)
        ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours == ref
        assert tok.encode(ours, add_special_tokens=False) == hf_tok.encode(
            ref, add_special_tokens=False
        )
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == (
        hf_tok.apply_chat_template(CONVERSATION, add_generation_prompt=False, tokenize=False)
    )


def test_chat_template_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATION)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert (im_start, im_end) == (1, 2)
    assert ids[0] == im_start
    assert ids.count(im_start) == 4 and ids.count(im_end) == 3


def test_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert not tok.add_bos  # SmolLM2's GGUF says add_bos_token = false
    # <|im_end|> (the eos) first, then <|endoftext|>, as llama.cpp's end-of-generation set.
    assert tok.eos_token_ids == [2, 0]
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(28) == ","


def test_decode_round_trip(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>")
    assert tok.decode(ids) == "user\nhello"


def test_from_gguf_directly(smollm2_path: Path, tok: Tokenizer) -> None:
    direct = tokenizer_from_gguf(smollm2_path)
    for text in TEXTS:
        assert direct.encode(text) == tok.encode(text)
    assert direct.chat_template == tok.chat_template
    assert direct.eos_token_ids == tok.eos_token_ids


def test_save_load_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert (again.bos_token_id, again.eos_token_ids, again.add_bos, again.vocab_size) == (
        tok.bos_token_id,
        tok.eos_token_ids,
        tok.add_bos,
        tok.vocab_size,
    )
    assert again.special_token_ids == tok.special_token_ids
    assert again.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_no_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    base = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=[2], chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        base.apply_chat_template(CONVERSATION)


def test_template_helpers(tok: Tokenizer) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}"
        "{{ raise_exception('bad role') }}{% endif %}{{ m | tojson }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ extra }}"
    )
    t = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=[2], chat_template=template)
    out = t.apply_chat_template([{"role": "user", "content": "é"}], extra="!")
    assert out == '<|im_start|>{"role": "user", "content": "é"}4!'
    with pytest.raises(Exception, match="bad role"):
        t.apply_chat_template([{"role": "bad", "content": ""}])


def test_hf_backend_bos_from_post_processor(tok: Tokenizer, tmp_path: Path) -> None:
    """Without add_bos_token in tokenizer_config, BOS follows the tokenizer.json post-processor."""
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|im_start|>"}')
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.add_bos and hf.encode("hi")[0] == 1 and hf.encode("hi", False)[0] != 1
    assert hf.chat_template is None and hf.eos_token_ids == [0, 2]


# -- llama.cpp's reference tokenizations (ggml-vocab-*.gguf + .inp/.out) --------------------------

VOCAB_DIR = settings.llama_vocab_dir() or Path(
    "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/models"
)


@pytest.mark.slow  # reading a 150k-token GGUF vocabulary takes tens of seconds
@pytest.mark.parametrize("name", ["qwen2", "gpt-2", "llama-bpe", "starcoder"])
def test_llama_cpp_vocab(name: str) -> None:
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(
            f"{path} not present: unpack llama-cpp-python==0.3.36's sdist "
            "and set SLUICE_LLAMA_VOCAB_DIR to its vendor/llama.cpp/models"
        )
    tok = tokenizer_from_gguf(path)
    inputs = Path(f"{path}.inp").read_text().split("\n__ggml_vocab_test__\n")
    outputs = Path(f"{path}.out").read_text().split("\n")
    for text, expected in zip(inputs, outputs, strict=False):
        assert tok.encode(text, add_special_tokens=False) == [int(x) for x in expected.split()]


# ---- untrusted text and ids (hypothesis; `make fuzz` runs many more) ----------------------

# Any text, the model's special tokens' spellings and template syntax mixed in.
texts = st.lists(
    st.text() | st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "{{ 7 * 7 }}",
                                 "{% for m in messages %}", "\ud800", "\x00", "\r\n"]),
    max_size=8,
).map("".join)  # fmt: skip
FUZZ = hypothesis_settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Letters, digits, punctuation, symbols and spacing of the Basic Multilingual Plane.
printable = st.text(
    st.characters(categories=("L", "M", "N", "P", "S", "Zs"), max_codepoint=0xFFFF)
    | st.sampled_from("\n\t\r ")
)


@FUZZ
@given(text=texts)
def test_any_text_encodes_or_is_named(tok: Tokenizer, text: str) -> None:
    # A lone surrogate (JSON and Python can spell one) is a ValueError that says so;
    # any other text gives ids of the vocabulary that decode to text.
    if not _is_text(text):
        with pytest.raises(ValueError, match="not valid Unicode"):
            tok.encode(text)
        return
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert isinstance(tok.decode(ids, skip_special_tokens=False), str)


@FUZZ
@given(text=printable)
def test_printable_text_round_trips(tok: Tokenizer, text: str) -> None:
    # Byte-level BPE gives such text back exactly (SmolLM2's vocabulary lacks a few
    # control bytes and lead bytes of unassigned planes, which come back changed).
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


@FUZZ
@given(ids=st.lists(st.integers(-(2**40), 2**40) | st.integers(0, 49_151), max_size=20))
def test_any_ids_decode_or_are_named(tok: Tokenizer, ids: list[int]) -> None:
    if all(0 <= i < 2**32 for i in ids):
        assert isinstance(tok.decode(ids), str)  # partial UTF-8 becomes U+FFFD
    else:
        with pytest.raises(ValueError, match="out of range"):
            tok.decode(ids)


@FUZZ
@given(content=texts.filter(_is_text), name=st.sampled_from(["user", "assistant", "system"]))
def test_message_text_reaches_the_prompt_verbatim(tok: Tokenizer, content: str, name: str) -> None:
    # Message text is data to the template, never template code: "{{ 7 * 7 }}" stays.
    rendered = tok.apply_chat_template([{"role": name, "content": content}])
    assert content in rendered
