"""Tool calling on a real model through a real `sluice serve`: how often each API and
tool_choice yields the call the question asks for, with arguments valid against the
function's schema, and how long a reply takes.

Ten questions, each answered by one of three functions (weather, currency conversion,
time zone); every question is asked with tool_choice `auto`, `required` and the named
function, through /v1/chat/completions, /v1/messages (Anthropic) and /v1/responses, at
temperature 0. `required` and a named function are enforced by a grammar, so their
calls always parse; what they measure is whether the model picks the right function
and fills the arguments sensibly. `auto` measures the model and the parser together.

    python benchmarks/tool_calls.py --model qwen2.5-coder-0.5b
    python benchmarks/tool_calls.py --model qwen2.5-coder-1.5b --output /tmp/tools.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anthropic
import jsonschema
import openai

from benchmarks.common import add_output_arg, format_table, write_result
from benchmarks.serve import start_sluice, stop

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CONVERT = {
    "type": "object",
    "properties": {
        "amount": {"type": "number"},
        "from_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
        "to_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
    },
    "required": ["amount", "from_currency", "to_currency"],
}
TIMEZONE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = {
    "get_weather": ("The current weather in a city", WEATHER),
    "convert_currency": ("Convert an amount between currencies", CONVERT),
    "get_time": ("The current local time in a city", TIMEZONE),
}
QUESTIONS = [
    ("What is the weather like in Paris today?", "get_weather", "paris"),
    ("Is it raining in Tokyo right now?", "get_weather", "tokyo"),
    ("How warm is it in Cairo?", "get_weather", "cairo"),
    ("Convert 100 US dollars to euros.", "convert_currency", "100"),
    ("How many yen is 50 pounds?", "convert_currency", "50"),
    ("I have 20 EUR, what is that in USD?", "convert_currency", "20"),
    ("What time is it in Sydney?", "get_time", "sydney"),
    ("Tell me the local time in New York.", "get_time", "new york"),
    ("What's the time in Berlin at the moment?", "get_time", "berlin"),
    ("Do I need an umbrella in London today?", "get_weather", "london"),
]
CHOICES = ("auto", "required", "named")
APIS = ("chat", "messages", "responses")


def _ask(api: str, url: str, model: str, question: str, choice: str, name: str) -> Any:
    """(function name, arguments object) of the reply's first call, or None."""
    if api == "chat":
        tools: Any = [{"type": "function", "function": {"name": n, "description": d,
                       "parameters": p}} for n, (d, p) in FUNCTIONS.items()]  # fmt: skip
        tc: Any = {"type": "function", "function": {"name": name}} if choice == "named" else choice
        r = openai.OpenAI(base_url=f"{url}/v1", api_key="x").chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], tools=tools,
            tool_choice=tc, temperature=0, max_tokens=96,
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls or []
        return (calls[0].function.name, json.loads(calls[0].function.arguments)) if calls else None
    if api == "messages":
        tools = [
            {"name": n, "description": d, "input_schema": p} for n, (d, p) in FUNCTIONS.items()
        ]
        tc = {"type": "tool", "name": name} if choice == "named" else {
            "type": {"auto": "auto", "required": "any"}[choice]}  # fmt: skip
        m = anthropic.Anthropic(base_url=url, api_key="x").messages.create(
            model=model, max_tokens=96, messages=[{"role": "user", "content": question}],
            tools=tools, tool_choice=tc, extra_body={"temperature": 0},
        )  # fmt: skip
        uses = [b for b in m.content if b.type == "tool_use"]
        return (uses[0].name, uses[0].input) if uses else None
    tools = [{"type": "function", "name": n, "description": d, "parameters": p}
             for n, (d, p) in FUNCTIONS.items()]  # fmt: skip
    tc = {"type": "function", "name": name} if choice == "named" else choice
    resp = openai.OpenAI(base_url=f"{url}/v1", api_key="x").responses.create(
        model=model, input=question, tools=tools, tool_choice=tc, temperature=0,
        max_output_tokens=96, store=False,
    )  # fmt: skip
    items = [i for i in resp.output if i.type == "function_call"]
    return (items[0].name, json.loads(items[0].arguments)) if items else None


def _right(call: Any, name: str, expect: str) -> bool:
    if call is None or call[0] != name:
        return False
    try:
        jsonschema.validate(call[1], FUNCTIONS[name][1])
    except jsonschema.ValidationError:
        return False
    return expect in json.dumps(call[1]).lower()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--apis", default=",".join(APIS), help="comma-separated, of " + ", ".join(APIS))
    add_output_arg(ap, "tool_calls")
    args = ap.parse_args()
    proc, url = start_sluice(["--model", args.model, "--num-threads", str(args.threads)])
    cells: dict[str, dict[str, Any]] = {}
    try:
        for api in args.apis.split(","):
            for choice in CHOICES:
                right, seconds = 0, []
                for question, name, expect in QUESTIONS:
                    t0 = time.perf_counter()
                    call = _ask(api, url, args.model, question, choice, name)
                    seconds.append(time.perf_counter() - t0)
                    right += _right(call, name, expect)
                cells[f"{api}/{choice}"] = {
                    "right": right,
                    "asked": len(QUESTIONS),
                    "median_seconds": statistics.median(seconds),
                }
    finally:
        stop(proc)
    rows = [
        [k, f"{v['right']}/{v['asked']}", f"{v['median_seconds']:.2f}"] for k, v in cells.items()
    ]
    print(format_table(["api/tool_choice", "right calls", "median s"], rows))
    result = {"model": args.model, "questions": len(QUESTIONS), "cells": cells}
    print("wrote", write_result("tool_calls", result, args.output, threads=args.threads))


if __name__ == "__main__":
    main()
