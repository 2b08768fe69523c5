"""Reasoning models' thinking, split from their answer (``--reasoning-parser``).

Qwen3, QwQ and the DeepSeek-R1 family write their thinking between ``<think>`` and
``</think>``, then the answer. The split goes to ``reasoning_content`` (and
``reasoning``, vLLM's newer name) in chat completions and to thinking blocks in the
Messages API; only the answer is parsed for tool calls, so a call the model merely
considers while thinking is not made.

Where the thinking starts: with the opening tag at the start of the output, or
already open in the prompt (templates that end the generation prompt with
``<think>\\n``, as DeepSeek-R1's and Qwen3's thinking-only ones do). ``deepseek_r1``
also treats an output without the opening tag as thinking, as R1's older templates
leave the tag to the model and it sometimes drops it. An output that ends while
still thinking (cut off by max_tokens) is all thinking.

Like the tool-call parser, it is incremental and decides only on the text seen, so
the streamed pieces reassemble into exactly the non-streamed split: a possible tag's
first characters wait for the next piece, and the whitespace around the thinking is
left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.core.choices import ReasoningParserName
from sluice.server.tool_calls import TrimmedText, partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its thinking."""

    name: ReasoningParserName
    start: str = THINK_START
    end: str = THINK_END
    # The output begins inside the thinking even without the opening tag.
    always_open: bool = False

    def opens(self, prompt_text: str) -> bool:
        """Whether an output of a prompt ending in `prompt_text` starts inside the thinking."""
        return self.always_open or prompt_text.rstrip().endswith(self.start)

    def parser(self, prompt_text: str) -> ReasoningParser:
        """A parser for one output of a prompt whose text is `prompt_text`."""
        return ReasoningParser(self, self.opens(prompt_text))


REASONING_FORMATS: dict[ReasoningParserName, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_open=True),
}


class ReasoningParser:
    """Splits one output, fed in pieces, into (reasoning, content) deltas."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool) -> None:
        self.fmt = fmt
        # "start": the opening tag may still come; "think": inside; "answer": after.
        self._state = "start"
        self._open = thinking  # the thinking has begun without the tag (which may follow)
        self._buf = ""
        self._reasoning = TrimmedText()
        self._content = TrimmedText()
        self.thought = False  # whether any thinking was seen

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(self.fmt.start):
                self._buf, self._state = stripped[len(self.fmt.start) :], "think"
            elif not final and self.fmt.start.startswith(stripped):
                return "", ""  # maybe the opening tag: wait
            else:
                self._state = "think" if self._open else "answer"
        if self._state == "think":
            self.thought = True
            k = self._buf.find(self.fmt.end)
            if k < 0:
                keep = 0 if final else partial_suffix(self._buf, 0, self.fmt.end)
                reasoning = self._reasoning.add(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning, ""
            reasoning = self._reasoning.add(self._buf[:k])
            self._buf, self._state = self._buf[k + len(self.fmt.end) :], "answer"
        content, self._buf = self._content.add(self._buf) if self.thought else self._buf, ""
        return reasoning, content
