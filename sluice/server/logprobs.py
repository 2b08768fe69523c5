"""Logprobs in OpenAI's two shapes (chat's ``content`` list, completions' legacy object),
and each token's true bytes.

A byte-level BPE token can hold part of a UTF-8 character (an emoji or a CJK character
is often split across two or three tokens). Its decoded text is then U+FFFD, so the
``bytes`` field is built from the token itself, not from its text: concatenated over a
reply, the bytes decode to the reply, which is what the field is for.
"""

from __future__ import annotations

import math
import re
import weakref
from typing import Any

import tokenizers.decoders

from sluice.loader.tokenizer import Tokenizer
from sluice.outputs import Logprob

# JSON has no -inf; OpenAI clients expect a number, so clamp like vLLM does.
_MIN_LOGPROB = -9999.0
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: token character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _gpt2_byte_decoder()
_IS_BYTE_LEVEL: weakref.WeakKeyDictionary[Tokenizer, bool] = weakref.WeakKeyDictionary()


def _byte_level(tokenizer: Tokenizer) -> bool:
    known = _IS_BYTE_LEVEL.get(tokenizer)
    if known is None:
        backend = getattr(tokenizer, "backend", None)
        decoder = getattr(backend, "decoder", None)
        known = _IS_BYTE_LEVEL[tokenizer] = isinstance(decoder, tokenizers.decoders.ByteLevel)
    return known


def token_bytes(tokenizer: Tokenizer, token_id: int, text: str) -> list[int]:
    """The UTF-8 bytes token `token_id` contributes to a text (`text`: its decoded form)."""
    if token_id in getattr(tokenizer, "special_token_ids", ()):
        return list(text.encode("utf-8"))
    try:
        piece = tokenizer.id_to_token(token_id)
    except (AttributeError, IndexError):
        return list(text.encode("utf-8"))
    if _byte_level(tokenizer):
        try:
            return [_BYTE_DECODER[ch] for ch in piece]
        except KeyError:  # an added token spelled in plain text
            return list(piece.encode("utf-8"))
    if m := _SPM_BYTE.fullmatch(piece):  # SentencePiece's byte fallback
        return [int(m.group(1), 16)]
    return list(piece.replace(_SPM_SPACE, " ").encode("utf-8"))


def _lp_value(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _token_text(tokenizer: Tokenizer, token_id: int, lp: Logprob) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _ranked(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    return sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
        key=lambda item: item[1].rank or 0,
    )


def _chat_item(tokenizer: Tokenizer, token_id: int, lp: Logprob) -> dict[str, Any]:
    text = _token_text(tokenizer, token_id, lp)
    return {
        "token": text,
        "logprob": _lp_value(lp.logprob),
        "bytes": token_bytes(tokenizer, token_id, text),
    }


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int
) -> dict[str, Any]:
    content = []
    for tok, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(tok)
        if chosen is None:
            continue
        item = _chat_item(tokenizer, tok, chosen)
        item["top_logprobs"] = [_chat_item(tokenizer, t, lp) for t, lp in _ranked(entry, top_n)]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    top_n: int,
    offset: int,
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object, and the text offset after these tokens."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for tok, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(tok)
        if chosen is None:
            continue
        text = _token_text(tokenizer, tok, chosen)
        tokens.append(text)
        token_logprobs.append(_lp_value(chosen.logprob))
        alts = {
            _token_text(tokenizer, t, lp): _lp_value(lp.logprob) for t, lp in _ranked(entry, top_n)
        }
        alts.setdefault(text, _lp_value(chosen.logprob))
        top.append(alts)
        offsets.append(offset)
        offset += len(text)
    obj = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return obj, offset
