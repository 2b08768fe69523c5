"""Structured output: schema compliance, what constraints cost per token, and what
forced tokens save, in one run of the Python engine.

Why these three: a constraint is only worth having if (a) real schemas compile and the
output follows them, (b) masking every step does not slow decoding down much, and
(c) the tokens a grammar forces (keys, quotes, separators) really skip forward passes.

(a) compliance: every schema of the JSONSchemaBench sample (shared/data/
    json_schemas.jsonl, 180 schemas), greedy, all in one batch: how many the compiler
    takes, how many outputs validate (`jsonschema`, the schema's own draft, formats not
    checked) among all, and how many hit --max-tokens. Compile time per schema with a
    fresh compiler (no cache): p50, p99, max.
(b) TPOT: the same prompts (the first --tpot-prompts compiled schemas, through the
    chat template) with each request constrained by its schema, against no constraint
    (ignore_eos, and as many tokens per request as its constrained greedy output has,
    so both sides prefill the same prompts per output token: a side whose requests
    ended sooner would otherwise pay more prompts per token), in a closed loop of
    --concurrency streams per level; TPOT = (finished - first token) / (output
    tokens - 1) per request, p50 over requests, median of --rounds interleaved
    rounds; the ratio is constrained / free (target <= 1.10). Forced tokens count as
    output tokens (the client sees them), so the ratio includes what forcing saves;
    the median time of a decode step (no prompt in it) is reported beside it: what
    the masks cost per forward pass.
(c) tokens per forward pass on a schema whose keys are all fixed: output tokens /
    engine steps of each request run alone, summed over --forced-prompts prompts
    (target >= 1.3).

Writes benchmarks/results/structured.json (--output).

Run from the repo root:
    .venv/bin/python benchmarks/structured.py
    .venv/bin/python benchmarks/structured.py --num-schemas 8 --concurrency 1,4 \
        --tpot-prompts 2,4 --tpot-max-tokens 16 --forced-prompts 2 --rounds 1
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from typing import Any  # noqa: E402

import jsonschema  # noqa: E402

from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_engine_args,
    add_output_arg,
    add_rounds_arg,
    chat_ids,
    compare,
    engine_options,
    fmt_spread,
    format_table,
    interleave,
    percentile,
    ratio,
    shown_path,
    tpot,
    write_result,
)
from sluice import LLM  # noqa: E402
from sluice.core.errors import RequestError  # noqa: E402
from sluice.core.structured_output import StructuredOutput  # noqa: E402
from sluice.engine.engine import LLMEngine  # noqa: E402
from sluice.outputs import RequestOutput  # noqa: E402
from sluice.sampling_params import SamplingParams  # noqa: E402
from sluice.structured import GrammarCompiler  # noqa: E402

TARGET_TPOT_RATIO = 1.10
TARGET_TOKENS_PER_STEP = 1.3
SCHEMAS_ENV = "SLUICE_JSON_SCHEMAS"
# The largest schemas are 150 KB, beyond the model's context: the prompt shows the
# start of the text, the constraint is always the whole schema.
PROMPT_SCHEMA_CHARS = 2000
TPOT_METRICS = ("tpot_p50_ms", "tpot_mean_ms", "decode_step_p50_ms", "output_tokens")
# Every key fixed and in order: keys, quotes and separators are forced tokens.
FIXED_KEYS = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "maxLength": 12},
        "last_name": {"type": "string", "maxLength": 12},
        "year_of_birth": {"type": "integer", "minimum": 1900, "maximum": 2024},
        "favourite_colour": {"enum": ["red", "green", "blue"]},
        "is_employed": {"type": "boolean"},
    },
    "required": ["first_name", "last_name", "year_of_birth", "favourite_colour", "is_employed"],
    "additionalProperties": False,
}
FORCED_PROMPTS = [
    "Invent a person.",
    "Describe a fictional scientist.",
    "Make up a character for a novel.",
    "Give me the details of a customer.",
    "Create a profile for a football player.",
    "Describe your best friend.",
    "Invent a painter from the 1900s.",
    "Describe a pilot.",
]
Message = dict[str, str]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="sluice model (alias/path; default smollm2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument(
        "--schemas",
        type=Path,
        default=None,
        help=f"JSONSchemaBench sample (default: ${SCHEMAS_ENV}, else "
        "tests/data/json_schemas.jsonl)",
    )
    g = ap.add_argument_group("(a) compliance")
    g.add_argument("--num-schemas", type=int, default=0, help="first N schemas (0: all)")
    g.add_argument("--max-tokens", type=int, default=1024)
    g = ap.add_argument_group("(b) TPOT")
    g.add_argument("--concurrency", default="1,16", help="streams per level")
    g.add_argument("--tpot-prompts", default="4,32", help="requests per level")
    g.add_argument("--tpot-max-tokens", type=int, default=128)
    g = ap.add_argument_group("(c) forced tokens")
    g.add_argument("--forced-prompts", type=int, default=len(FORCED_PROMPTS))
    ap.add_argument("--skip-compliance", action="store_true")
    ap.add_argument("--skip-tpot", action="store_true")
    ap.add_argument("--skip-forced", action="store_true")
    add_rounds_arg(ap)
    add_engine_args(ap)
    add_output_arg(ap, "structured")
    return ap.parse_args()


# ---- schemas and prompts ---------------------------------------------------------------------


def schema_file(given: Path | None) -> Path:
    if given is not None:
        return given
    if SCHEMAS_ENV in os.environ:
        return Path(os.environ[SCHEMAS_ENV])
    # The JSONSchemaBench sample, committed beside the tests.
    return REPO_ROOT / "tests" / "data" / "json_schemas.jsonl"


def load_schemas(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def schema_prompt(tok: Any, schema: Any) -> list[int]:
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > PROMPT_SCHEMA_CHARS:
        text = text[:PROMPT_SCHEMA_CHARS] + " ..."
    return chat_ids(
        tok,
        "Reply with a JSON object that matches this JSON Schema, and nothing else.\n\n"
        f"Schema:\n{text}",
    )


def schema_errors(schema: Any, text: str) -> list[str]:
    """Validation errors by the schema's own draft ($schema; 2020-12 when absent)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc}"]
    return [e.message[:200] for e in cls(schema).iter_errors(instance)]


# ---- (a) compliance --------------------------------------------------------------------------


def compile_times(engine: LLMEngine, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds to compile each schema with a fresh compiler (nothing cached); the
    compiler's tokenizer is built first, once, as the engine does at its first use."""
    compiler = GrammarCompiler(
        engine.tokenizer.backend, engine.model_config.vocab_size, engine.tokenizer.eos_token_ids
    )
    _ = compiler.tokenizer
    times = []
    for row in rows:
        t0 = time.perf_counter()
        compiler._build(StructuredOutput(json=row["schema"]))
        times.append(time.perf_counter() - t0)
    return {
        "p50_ms": percentile(times, 50) * 1e3,
        "p99_ms": percentile(times, 99) * 1e3,
        "max_ms": max(times) * 1e3,
        "n": len(times),
    }


def compliance(llm: LLM, rows: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    engine = llm.engine
    rejected: dict[str, str] = {}
    accepted = []
    for row in rows:
        try:
            engine.grammars.compile(StructuredOutput(json=row["schema"]))
        except RequestError as exc:
            rejected[row["id"]] = str(exc)
            continue
        accepted.append(row)
    sps = [
        SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            structured_output=StructuredOutput(json=row["schema"]),
        )
        for row in accepted
    ]
    prompts = [schema_prompt(llm.tokenizer, row["schema"]) for row in accepted]
    before = engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = engine.stats()
    valid, invalid, length = [], {}, []
    for row, out in zip(accepted, outs, strict=True):
        o = out.outputs[0]
        if o.finish_reason == "length":
            length.append(row["id"])
            continue
        errors = schema_errors(row["schema"], o.text)
        if errors:
            invalid[row["id"]] = {"errors": errors, "text": o.text[:500]}
        else:
            valid.append(row["id"])
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "total": len(rows),
        "compiled": len(accepted),
        "valid": len(valid),
        "length": len(length),
        "invalid": len(invalid),
        "max_tokens": max_tokens,
        "rejected_ids": rejected,
        "length_ids": length,
        "invalid_ids": invalid,
        "seconds": seconds,
        "output_tokens": output_tokens,
        "forced_tokens": after["num_forced_tokens"] - before["num_forced_tokens"],
        "compile": compile_times(engine, rows),
    }


# ---- (b) TPOT --------------------------------------------------------------------------------


def _decoding_only(engine: LLMEngine) -> bool:
    """Nothing waits and every running request has its prompt in the cache: the next
    step is all decodes (and forced-token chunks)."""
    sched = engine.scheduler
    return not sched.waiting and all(
        r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
    )


def run_closed_loop(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    concurrency: int,
) -> tuple[list[RequestOutput], float, list[float]]:
    """At most `concurrency` requests in flight; each finished one is replaced by the
    next, so the batch stays full. Outputs in completion order, the wall time, and the
    seconds of each step that ran decodes only."""
    pending = deque(zip(prompts, params, strict=True))
    ids = itertools.count()
    in_flight: set[str] = set()
    done: list[RequestOutput] = []
    decode_steps: list[float] = []

    def submit() -> None:
        prompt, sp = pending.popleft()
        rid = f"structured-{next(ids)}"
        engine.add_request(rid, prompt, sp)
        in_flight.add(rid)

    t0 = time.perf_counter()
    while pending and len(in_flight) < concurrency:
        submit()
    while in_flight:
        decoding = _decoding_only(engine)
        t_step = time.perf_counter()
        outs = engine.step()
        if decoding:
            decode_steps.append(time.perf_counter() - t_step)
        for out in outs:
            if out.finished and out.request_id in in_flight:
                in_flight.remove(out.request_id)
                done.append(out)
                if pending:
                    submit()
    return done, time.perf_counter() - t0, decode_steps


def constrained_params(schemas: list[Any], max_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0, max_tokens=max_tokens, structured_output=StructuredOutput(json=s)
        )
        for s in schemas
    ]


def measure_tpot(
    llm: LLM,
    prompts: list[list[int]],
    schemas: list[Any],
    constrained: bool,
    concurrency: int,
    lengths: list[int],
) -> dict[str, Any]:
    """One closed-loop run; the free side generates, for each prompt, as many tokens as
    the constrained side does (`lengths`), so both sides prefill the same prompts per
    output token and only the constraint differs."""
    engine = llm.engine
    engine.reset_prefix_cache()  # both sides start from the same (empty) cache
    if constrained:
        sps = constrained_params(schemas, max(lengths))
    else:
        sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    before = engine.stats()
    outs, seconds, decode_steps = run_closed_loop(engine, prompts, sps, concurrency)
    after = engine.stats()
    tpots = [t for t in map(tpot, outs) if t is not None]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tpot_p50_ms": percentile(tpots, 50) * 1e3,
        "tpot_mean_ms": sum(tpots) / len(tpots) * 1e3 if tpots else float("nan"),
        "decode_step_p50_ms": percentile(decode_steps, 50) * 1e3,
        "decode_steps": len(decode_steps),
        "output_tokens": tokens / len(outs),
        "sampled_tokens": after["num_generated_tokens"] - before["num_generated_tokens"],
        "forced_tokens": after["num_forced_tokens"] - before["num_forced_tokens"],
        "seconds": seconds,
    }


def tpot_levels(
    llm: LLM, rows: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.tpot_prompts.split(",")]
    if len(counts) != len(levels):
        raise SystemExit("--tpot-prompts needs one count per --concurrency level")
    compiled = [r for r in rows if _compiles(llm.engine, r["schema"])]
    results = []
    for c, n in zip(levels, counts, strict=True):
        chosen = [compiled[i % len(compiled)] for i in range(n)]
        prompts = [schema_prompt(llm.tokenizer, r["schema"]) for r in chosen]
        schemas = [r["schema"] for r in chosen]
        # Each request's constrained (greedy) output length, for the free side.
        first = llm.generate(
            prompts, constrained_params(schemas, args.tpot_max_tokens), use_tqdm=False
        )
        lengths = [max(2, len(o.outputs[0].token_ids)) for o in first]
        runs = interleave(
            ["constrained", "free"],
            args.rounds,
            lambda side, p=prompts, s=schemas, c=c, n=lengths: measure_tpot(
                llm, p, s, side == "constrained", c, n
            ),
            label=f"TPOT, {c} streams ({n} requests)",
        )
        results.append(
            {
                "concurrency": c,
                "num_prompts": n,
                "max_tokens": args.tpot_max_tokens,
                "comparison": compare(runs, TPOT_METRICS, baseline="free"),
                "forced_tokens": [r["forced_tokens"] for r in runs["constrained"]],
            }
        )
    return results


def _compiles(engine: LLMEngine, schema: Any) -> bool:
    try:
        engine.grammars.compile(StructuredOutput(json=schema))
    except RequestError:
        return False
    return True


# ---- (c) forced tokens -----------------------------------------------------------------------


def forced_tokens(llm: LLM, num_prompts: int) -> dict[str, Any]:
    """Each prompt alone (so the engine's step counter is that request's): output
    tokens per engine step, the prefill step that samples the first token included."""
    engine = llm.engine
    sp = SamplingParams(
        temperature=0, max_tokens=256, structured_output=StructuredOutput(json=FIXED_KEYS)
    )
    per_request = []
    for text in (FORCED_PROMPTS * (num_prompts // len(FORCED_PROMPTS) + 1))[:num_prompts]:
        before = engine.stats()
        (out,) = llm.generate([chat_ids(llm.tokenizer, text)], sp, use_tqdm=False)
        after = engine.stats()
        o = out.outputs[0]
        per_request.append(
            {
                "prompt": text,
                "tokens": len(o.token_ids),
                "steps": after["num_steps"] - before["num_steps"],
                "forced": after["num_forced_tokens"] - before["num_forced_tokens"],
                "finish_reason": o.finish_reason,
                "valid": o.finish_reason == "stop" and not schema_errors(FIXED_KEYS, o.text),
                "text": o.text,
            }
        )
    tokens = sum(r["tokens"] for r in per_request)
    steps = sum(r["steps"] for r in per_request)
    return {
        "schema": FIXED_KEYS,
        "tokens": tokens,
        "steps": steps,
        "forced": sum(r["forced"] for r in per_request),
        "tokens_per_step": ratio(tokens, steps),
        "requests": per_request,
    }


# ---- report ----------------------------------------------------------------------------------


def report(result: dict[str, Any]) -> None:
    c = result.get("compliance")
    if c:
        cp = c["compile"]
        print(
            f"\n== (a) compliance, greedy, max_tokens {c['max_tokens']}: {c['valid']} valid / "
            f"{c['compiled']} compiled / {c['total']} schemas; {c['length']} hit max_tokens, "
            f"{c['invalid']} invalid; compile p50 {cp['p50_ms']:.2f} ms, p99 "
            f"{cp['p99_ms']:.2f} ms, max {cp['max_ms']:.1f} ms"
        )
        for sid, why in c["rejected_ids"].items():
            print(f"  rejected {sid}: {why}")
        for sid in c["length_ids"]:
            print(f"  max_tokens {sid}")
        for sid, why in c["invalid_ids"].items():
            print(f"  INVALID {sid}: {why['errors'][0]}")
    for lvl in result.get("tpot", []):
        cmp = lvl["comparison"]
        s = cmp["summary"]
        r = cmp["ratio_of_medians"]["constrained"]
        print(
            f"\n== (b) TPOT, {lvl['concurrency']} streams, {lvl['num_prompts']} requests, "
            f"max_tokens {lvl['max_tokens']}; median (min-max) of {cmp['rounds']} rounds =="
        )
        rows = [
            [
                label,
                fmt_spread(s["constrained"][m], 1.0, 2),
                fmt_spread(s["free"][m], 1.0, 2),
                f"{r[m]:.2f}",
            ]
            for label, m in (
                ("TPOT p50 (ms)", "tpot_p50_ms"),
                ("TPOT mean (ms)", "tpot_mean_ms"),
                ("decode step p50 (ms)", "decode_step_p50_ms"),
                ("output tokens / request", "output_tokens"),
            )
        ]
        print(format_table(["metric", "constrained", "free", "ratio"], rows))
        verdict = "PASS" if r["tpot_p50_ms"] <= TARGET_TPOT_RATIO else "above target"
        print(f"TPOT p50 ratio {r['tpot_p50_ms']:.2f} (target <= {TARGET_TPOT_RATIO}: {verdict})")
    f = result.get("forced")
    if f:
        verdict = "PASS" if f["tokens_per_step"] >= TARGET_TOKENS_PER_STEP else "below target"
        print(
            f"\n== (c) forced tokens: {f['tokens']} output tokens in {f['steps']} steps "
            f"({f['forced']} forced) = {f['tokens_per_step']:.2f} tokens per forward pass "
            f"(target >= {TARGET_TOKENS_PER_STEP}: {verdict})"
        )


def main() -> None:
    args = parse_args()
    opts = engine_options(args)
    path = schema_file(args.schemas)
    rows = load_schemas(path)
    if args.num_schemas:
        rows = rows[: args.num_schemas]
    result: dict[str, Any] = {
        "config": {**vars(args), "schemas": str(path)},
        "engine_options": opts,
    }
    print("loading sluice ...", flush=True)
    llm = LLM(args.model, **opts)
    llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    stats = llm.stats()
    result["dtype"], result["quantization"] = stats["dtype"], stats["quantization"]
    if not args.skip_compliance:
        result["compliance"] = compliance(llm, rows, args.max_tokens)
    if not args.skip_tpot:
        result["tpot"] = tpot_levels(llm, rows, args)
    if not args.skip_forced:
        result["forced"] = forced_tokens(llm, args.forced_prompts)
    report(result)
    out = write_result("structured", result, args.output)
    print(f"\nwrote {shown_path(out)}")


if __name__ == "__main__":
    main()
