"""Incremental detokenization and stop handling for one output sequence.

The engine calls ``SequenceOutputState.append`` once per generated token, so everything
here is O(1) in the length of the output: text is decoded from a small window of recent
tokens (the prefix_offset/read_offset technique), and stop strings are searched for only
around the newly added text.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from sluice.core.choices import FinishReason
from sluice.core.sampling_params import SamplingParams

# Prompt tokens kept as left context so the first output token decodes as it would
# mid-text (decoders that strip a leading space or join sub-words need the neighbours).
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes and every byte-level token carries at least one,
# so a window still ending in U+FFFD after this many tokens is invalid UTF-8 from the
# model, not a character in progress; emitting it keeps each step's decode small.
_MAX_PENDING_TOKENS = 8
# Drop consumed window tokens in batches so trimming the list stays amortised O(1).
_TRIM_THRESHOLD = 64

_REPLACEMENT_CHAR = "\ufffd"


class TokenizerLike(Protocol):
    """The part of sluice's tokenizer this module needs."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_token(self, i: int) -> str: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def special_token_ids(self) -> set[int]: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, one token at a time.

    Each step decodes only ``ids[prefix_offset:]`` (a few tokens) and emits the part
    beyond what ``ids[prefix_offset:read_offset]`` decoded to. While the window decodes
    to text ending in U+FFFD (a multi-byte character whose bytes are spread over several
    byte-level tokens), nothing is emitted and the offsets stay put until it completes.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        # Only the window is stored; the full output ids live with the caller.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached
        self._special = tokenizer.special_token_ids

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _get_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _advance(self, new_text: str) -> str:
        prefix_text = self._get_prefix_text()
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += delta
        return delta

    def add_token(self, token_id: int) -> str:
        """Append one token; return the text it completed (often "", never partial)."""
        # Skipped specials add no text; keeping them out of the window also stops a run of
        # them (ignore_eos benchmarks repeat EOS) from growing the window forever.
        if self.skip_special_tokens and token_id in self._special:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(self._ids) - self._read_offset < _MAX_PENDING_TOKENS and (
            new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= len(self._get_prefix_text())
        ):
            return ""
        return self._advance(new_text)

    def flush(self) -> str:
        """Emit text still held back (an incomplete character decodes as U+FFFD).

        Called when the sequence ends, so the final text matches a full decode.
        """
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._get_prefix_text()):
            return ""
        return self._advance(new_text)


class SequenceOutputState:
    """Text, stop-string detection and streaming hold-back for one output sequence.

    Call ``append(token_id, max_tokens)`` once per sampled token; it returns True on the
    token that finishes the sequence. ``take_delta()`` yields the text to stream.

    Stop rules, checked in this order after each token:

    a. token in ``params.stop_token_ids`` (once ``len(token_ids) >= min_tokens``): finish
       "stop", ``stop_reason`` = the token id; its text is kept unless it is special.
    b. EOS (unless ``ignore_eos``, once ``len(token_ids) >= min_tokens``): finish "stop",
       ``stop_reason`` None; EOS adds no text.
    c. a stop string ending in the newly added text (once ``len >= min_tokens``): text is
       cut at the match start (or after the match with ``include_stop_str_in_output``);
       finish "stop", ``stop_reason`` = the stop string.
    d. ``len(token_ids) >= max_tokens``: finish "length".
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Collection[int] | None = None,
    ) -> None:
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self._special = tokenizer.special_token_ids
        self._eos = frozenset(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self._stop_token_ids = frozenset(params.stop_token_ids or ())
        stop = params.stop
        self._stop_strings: list[str] = [stop] if isinstance(stop, str) else list(stop or ())
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)
        self._sent = 0  # chars of text already returned by take_delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, max_tokens: int) -> bool:
        """Add one sampled token and apply the stop rules; True if it just finished."""
        if self.finished:
            raise RuntimeError(f"sequence already finished ({self.finish_reason})")
        self.token_ids.append(token_id)
        can_stop = len(self.token_ids) >= self.params.min_tokens

        if can_stop and token_id in self._stop_token_ids:
            if token_id not in self._special:
                self._add_text(self._detok.add_token(token_id))
                if self.finished:  # its text completed a stop string first
                    return True
            self._add_text(self._detok.flush())
            return self._finish("stop", token_id)
        if can_stop and not self.params.ignore_eos and token_id in self._eos:
            self._add_text(self._detok.flush())
            return self._finish("stop", None)

        self._add_text(self._detok.add_token(token_id))
        if self.finished:
            return True
        if len(self.token_ids) >= max_tokens:
            self._add_text(self._detok.flush())
            # The flushed tail may itself complete a stop string, which then wins.
            return self.finished or self._finish("length", None)
        return False

    def finish_complete(self) -> bool:
        """The output's grammar is complete (nothing may follow): stop as at EOS."""
        if not self.finished:
            self._add_text(self._detok.flush())
        return self.finished or self._finish("stop", None)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> bool:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return True

    def _add_text(self, delta: str) -> None:
        if not delta or self.finished:
            return
        old_len = len(self.text)
        self.text += delta
        if self._stop_strings and len(self.token_ids) >= self.params.min_tokens:
            self._check_stop_strings(old_len)

    def _check_stop_strings(self, old_len: int) -> None:
        # Only matches that end inside the new text count: anything wholly in older text
        # was either found already or predates min_tokens. Starting each search
        # len(stop)-1 chars back finds a stop string split across tokens.
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            pos = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return
        pos, stop = best
        end = pos + len(stop) if self.params.include_stop_str_in_output else pos
        self.text = self.text[:end]
        self._finish("stop", stop)

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        text = self.text
        held = 0
        for stop in self._stop_strings:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def take_delta(self) -> str:
        """Text not returned by earlier calls.

        While running, a tail that could be the start of a stop string is held back, so a
        stop string never reaches a streaming client; once finished, all the rest is
        returned. Concatenating every delta gives the final ``text``.
        """
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        if end <= self._sent:
            return ""
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
