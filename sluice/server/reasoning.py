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

gpt-oss (``openai_gptoss``, vLLM's name) writes OpenAI's harmony format instead: a
sequence of messages, each a header naming its channel and a body,
``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>
...``, the markers special tokens (so the reply is decoded with them kept). The
analysis channel is the thinking; the final channel, and commentary addressed to no
one (a preamble to the user), the answer. A message addressed to a function
(``to=functions.f`` in its header) is a tool call, its body the arguments. An output
that does not open with a marker is all answer.

Like the tool-call parser, both are incremental and decide only on the text seen, so
the streamed pieces reassemble into exactly the non-streamed split: a possible tag's
first characters wait for the next piece, and the whitespace around the thinking is
left out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from sluice.core.choices import ReasoningParserName
from sluice.server.tool_calls import HERMES_END, HERMES_START, TrimmedText, partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningSplitter(Protocol):
    """Splits one output, fed in pieces, into (reasoning, content) deltas."""

    def feed(self, text: str, final: bool) -> tuple[str, str]: ...


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its thinking. `start` and `end` bound it for a constraint's
    grammar (structured.with_thinking) as well as for the parser."""

    name: ReasoningParserName
    start: str = THINK_START
    end: str = THINK_END
    # The output begins inside the thinking even without the opening tag.
    always_open: bool = False
    # Harmony's channels (gpt-oss), not tags: the markers are special tokens, which the
    # reply must be decoded with.
    harmony: bool = False
    # Where the thinking ends before a required tool call, if not at `end` (harmony: the
    # next message's role; the call is that message, on its own channel, not the final
    # answer's).
    call_end: str | None = None

    def opens(self, prompt_text: str) -> bool:
        """Whether an output of a prompt ending in `prompt_text` starts inside the thinking."""
        return self.always_open or prompt_text.rstrip().endswith(self.start)

    def parser(self, prompt_text: str) -> ReasoningSplitter:
        """A parser for one output of a prompt whose text is `prompt_text`."""
        if self.harmony:
            return HarmonyParser()
        return ReasoningParser(self, self.opens(prompt_text))


REASONING_FORMATS: dict[ReasoningParserName, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_open=True),
    "openai_gptoss": ReasoningFormat(
        "openai_gptoss",
        start="<|channel|>analysis<|message|>",
        end="<|end|><|start|>assistant<|channel|>final<|message|>",
        harmony=True,
        call_end="<|end|><|start|>assistant",
    ),
}


def reasoning_format(
    name: ReasoningParserName | None, chat_template: str | None
) -> ReasoningFormat | None:
    """The format --reasoning-parser names; without one, harmony's where the model's
    chat template writes harmony (gpt-oss's: its markers are special tokens, so without
    the split a reply would reach the client with its channel names run into the
    text; llama.cpp and Ollama split it unasked too). None: replies are not split."""
    if name is not None:
        return REASONING_FORMATS[name]
    if chat_template is not None and all(m in chat_template for m in _HARMONY_TEMPLATE):
        return REASONING_FORMATS["openai_gptoss"]
    return None


# What a harmony chat template writes (gpt-oss's).
_HARMONY_TEMPLATE = ("<|channel|>", "<|message|>", "<|start|>")


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


# Harmony's markers: a header runs up to <|message|>; a body ends at <|end|> (another
# message follows), <|return|> or <|call|> (the last), or a <|start|> (a header whose
# message's end the model left out).
_MESSAGE = "<|message|>"
_BODY_END = re.compile(r"<\|(end|return|call)\|>|(?=<\|start\|>)")
_BODY_MARKERS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"\bto=functions\.([\w.-]+)")
_OPENERS = ("<|channel|>", "<|start|>")


class HarmonyParser:
    """Splits one gpt-oss output in harmony's channels: analysis to the reasoning, the
    rest to the content (see the module's description). A message to a function
    (``to=functions.f``) joins the content as the call block the tool-call parser reads
    (Hermes's ``<tool_call>`` with its body as the arguments), so calls need nothing
    new downstream: streamed, checked against the request's functions, finish_reason."""

    def __init__(self) -> None:
        # "open": nothing decided; "header"; "body"; "plain": not harmony, all content.
        self._state = "open"
        self._buf = ""
        self._to_reasoning = False
        self._call = False  # the open body is a call's arguments
        self._new_message = False
        self._reasoning = TrimmedText()
        self._content = TrimmedText()

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        progressing = True
        while progressing:  # each step consumes what the buffer decides
            progressing = self._step(final, reasoning, content)
        return "".join(reasoning), "".join(content)

    def _step(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the buffer decides; False when it needs more text."""
        if self._state == "open":
            head = self._buf.lstrip()
            if any(head.startswith(m) for m in _OPENERS):
                self._state = "header"
            elif not final and any(m.startswith(head) for m in _OPENERS):
                return False  # maybe a marker: wait
            else:
                self._state = "plain"
        if self._state == "plain":
            content.append(self._content.add(self._buf))
            self._buf = ""
            return False
        if self._state == "header":
            return self._header(final, content)
        return self._body(final, reasoning, content)

    def _header(self, final: bool, content: list[str]) -> bool:
        k = self._buf.find(_MESSAGE)
        if k < 0:
            if final:  # cut off inside a header: nothing of it is text
                self._buf = ""
            return False
        header, self._buf = self._buf[:k], self._buf[k + len(_MESSAGE) :]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        self._to_reasoning = channel is not None and channel.group(1) == "analysis"
        self._to_reasoning &= recipient is None
        self._state, self._new_message = "body", True
        if recipient is not None:
            self._call = True
            opening = f'{HERMES_START}\n{{"name": {json.dumps(recipient.group(1))}, "arguments": '
            self._emit(opening, [], content)
        return True

    def _body(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        end = _BODY_END.search(self._buf)
        stop = len(self._buf) if end is None else end.start()
        if end is None and not final:
            stop -= max(partial_suffix(self._buf, 0, m) for m in _BODY_MARKERS)
        self._emit(self._buf[:stop], reasoning, content)
        if end is None and not final:
            self._buf = self._buf[stop:]
            return False
        if self._call:  # the call's block closes with its message
            self._emit(f"}}\n{HERMES_END}", reasoning, content)
            self._call = False
        self._buf, self._state = ("" if end is None else self._buf[end.end() :]), "header"
        return end is not None

    def _emit(self, body: str, reasoning: list[str], content: list[str]) -> None:
        target, out = (
            (self._reasoning, reasoning) if self._to_reasoning else (self._content, content)
        )
        if self._new_message and target.started:  # a paragraph between two messages
            body = "\n\n" + body
        self._new_message = False
        out.append(target.add(body))
