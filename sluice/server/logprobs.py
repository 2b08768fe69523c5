"""Logprobs in OpenAI's two shapes (chat's ``content`` list, completions' legacy object)."""

from __future__ import annotations

import math
from typing import Any

from sluice.loader.tokenizer import Tokenizer
from sluice.outputs import Logprob

# JSON has no -inf; OpenAI clients expect a number, so clamp like vLLM does.
_MIN_LOGPROB = -9999.0


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
        "bytes": list(text.encode("utf-8")),
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
