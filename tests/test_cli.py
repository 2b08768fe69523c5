"""`sluice generate` and `sluice chat` as subprocesses on the bundled model, and the
flags generated from EngineConfig."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from sluice import LLM, SamplingParams
from sluice.cli import build_parser, engine_config
from sluice.config import EngineConfig
from sluice.core.choices import DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES

CLI = [sys.executable, "-m", "sluice.cli"]


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, text=True, timeout=300, check=False
    )


def test_every_engine_option_is_a_flag_on_every_subcommand() -> None:
    parser = build_parser()
    for command in ("serve", "generate", "chat"):
        extra = ["x"] if command == "generate" else []
        args = parser.parse_args([command, *extra])
        # Untouched flags leave EngineConfig's own defaults in place.
        assert engine_config(args) == EngineConfig()
    args = parser.parse_args(
        ["serve", "--block-size", "32", "--max-model-len", "512", "--kv-cache-memory", "0.5",
         "--no-enable-prefix-caching", "--scheduling-policy", "priority", "--seed", "3",
         "--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
         "--num-threads", "1", "--device", "cpu", "--model", "smollm2-135m"]
    )  # fmt: skip
    cfg = engine_config(args)
    assert (cfg.block_size, cfg.max_model_len, cfg.kv_cache_memory) == (32, 512, 0.5)
    assert cfg.enable_prefix_caching is False and cfg.scheduling_policy == "priority"
    assert (cfg.seed, cfg.dtype, cfg.max_num_seqs, cfg.num_threads) == (3, "float32", 8, 1)
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["serve"]._actions}  # type: ignore[union-attr]
    assert set(EngineConfig.option_names()) <= flags
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= flags


def test_choice_flags_take_their_choices_from_core() -> None:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    actions = {a.dest: a for a in serve._actions}
    assert tuple(actions["dtype"].choices) == DTYPES
    assert tuple(actions["quantization"].choices) == QUANTIZATIONS
    assert tuple(actions["scheduling_policy"].choices) == SCHEDULING_POLICIES
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["serve", "--dtype", "float64"])
    assert exc.value.code == 2


def test_bad_engine_option_is_a_clean_error() -> None:
    r = _run(["generate", "hi", "--block-size", "0"])
    assert r.returncode == 2
    assert "block_size must be a positive integer" in r.stderr
    assert "Traceback" not in r.stderr
    r = _run(["generate", "hi", "--temperature", "-1"])
    assert r.returncode == 2 and "temperature" in r.stderr


# A small KV pool and context keep each run's start-up short.
SMALL = ["--kv-cache-memory", "0.1", "--max-model-len", "512"]
# fp32, the exact mode: the CLI's greedy text equals the in-process llm_fp32's.
EXACT = [*SMALL, "--dtype", "float32"]
GREEDY_6 = SamplingParams(temperature=0, max_tokens=6)


def test_generate_streams_text() -> None:
    r = _run(["generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
              *SMALL])  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_with_chat_template(llm_fp32: LLM) -> None:
    r = _run(["generate", "Say hello.", "--chat", "--max-tokens", "6", "--temperature", "0",
              *EXACT])  # fmt: skip
    assert r.returncode == 0, r.stderr
    # The templated prompt gives exactly what LLM.chat gives for the same message.
    (expected,) = llm_fp32.chat(
        [{"role": "user", "content": "Say hello."}], GREEDY_6, use_tqdm=False
    )
    assert r.stdout == expected.outputs[0].text + "\n"


def test_chat_reads_piped_stdin_until_exit(llm_fp32: LLM) -> None:
    r = _run(
        ["chat", "--max-tokens", "8", "--temperature", "0", "--system", "Be brief.", *EXACT],
        stdin="Hello!\n\nWhat is two plus two?\n/exit\nthis line is never read\n",
    )
    assert r.returncode == 0, r.stderr
    # Each answer is LLM.chat's for the conversation so far (template, system prompt and
    # history applied); nothing after /exit is answered, and no prompts are printed
    # when stdin is not a terminal.
    sp = SamplingParams(temperature=0, max_tokens=8)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    (first,) = llm_fp32.chat(conv, sp, use_tqdm=False)
    conv += [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "What is two plus two?"},
    ]
    (second,) = llm_fp32.chat(conv, sp, use_tqdm=False)
    assert r.stdout == first.outputs[0].text + "\n" + second.outputs[0].text + "\n"
