"""Chat templates are untrusted code (they ship inside model files): the sandbox stops
one that loops for hours, builds huge values or recurses without end, quickly and with
a TemplateError, and leaves real templates' output alone."""

from __future__ import annotations

import time
from typing import Any

import jinja2
import pytest

from sluice.loader import load_tokenizer
from sluice.loader.chat_sandbox import compile_chat_template, render_bounded
from sluice.loader.tokenizer import Tokenizer

HOSTILE = [
    ("nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}"
     "{% endfor %}{% endfor %}", "steps"),
    ("huge string", "{{ 'x' * 10000000000 }}", "10,000,000,000 items"),
    ("huge list", "{{ ([1] * 100000) * 100000 }}", "items"),
    ("huge power", "{{ 2 ** 100000000 }}", "power"),
    ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    ("internals", "{{ messages.__class__.__mro__ }}", ""),
]  # fmt: skip


@pytest.mark.parametrize(("case", "source", "says"), HOSTILE, ids=[c for c, _, _ in HOSTILE])
def test_hostile_templates_stop_quickly(case: str, source: str, says: str) -> None:
    template = compile_chat_template(source)
    t0 = time.perf_counter()
    try:
        out = render_bounded(template, {"messages": []})
    except jinja2.exceptions.TemplateError as exc:
        assert says in str(exc), exc
    else:
        assert case == "internals" and "object" not in out  # the sandbox hides them
    assert time.perf_counter() - t0 < 20  # hours without the bounds


def _conversation(n: int) -> list[dict[str, Any]]:
    turns = [{"role": "system", "content": "You are helpful."}]
    for i in range(n):
        turns.append({"role": "user", "content": f"Question {i}?"})
        turns.append({"role": "assistant", "content": f"Answer {i}."})
    return turns


def test_real_templates_render_the_same_and_far_under_the_budget() -> None:
    # The packaged Qwen2.5's template with tools, on a 200-turn conversation: the
    # bounded render equals jinja's plain one and uses a small part of the budget.
    tok: Tokenizer = load_tokenizer("qwen2.5-coder-0.5b")[1]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}}
             for i in range(20)]  # fmt: skip
    for source in (tok.chat_template, _QWEN_LIKE):
        assert source is not None
        template = compile_chat_template(source)
        variables = {"messages": _conversation(200), "tools": tools,
                     "add_generation_prompt": True, "bos_token": "", "eos_token": ""}  # fmt: skip
        assert render_bounded(template, variables) == template.render(**variables)


# A ChatML template that renders tools the way Qwen2.5's does (loops over tools and
# messages, JSON of each tool).
_QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
