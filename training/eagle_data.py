"""Training data for a self-drafting (EAGLE-style) head: the target's own answers and
its hidden states over them.

The head learns to predict the target's next feature (its final-normed hidden state)
from the current one and the next token, so the data is (tokens, features) of whole
sequences. The answers are the target's own greedy answers (self-distillation, as
Medusa-2 and EAGLE advise: the head then learns what this model says, not what a
data set's authors wrote) to prompts no benchmark uses: ShareGPT first turns from a
shuffle other than benchmarks/speculative.py's, and coding requests over standard
library functions other than its edit workload's. The features come from the engine's
own runner in its default dtype and weights, the ones the head sees when serving.

    .venv/bin/python training/eagle_data.py --out /tmp/eagle-smollm2.pt

writes a list of (token ids [L] int32, features [L, hidden] bfloat16), one per sequence.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import chat_ids
from benchmarks.datasets import sharegpt_prompts
from benchmarks.speculative import EDIT_SOURCES
from sluice import LLM, SamplingParams
from sluice.core.request import Request

# ShareGPT prompts the speculative and throughput benchmarks draw (seed 0, the first
# few hundred) are left out: this shuffle's prompts must not be among them.
_BENCH_SHAREGPT = 512
_CODE_MODULES = [
    "csv",
    "difflib",
    "email.utils",
    "ftplib",
    "gettext",
    "heapq",
    "http.cookies",
    "imaplib",
    "inspect",
    "ipaddress",
    "locale",
    "mailbox",
    "netrc",
    "ntpath",
    "optparse",
    "pathlib",
    "pickletools",
    "platform",
    "poplib",
    "pprint",
    "pydoc",
    "quopri",
    "reprlib",
    "sched",
    "smtplib",
    "statistics",
    "string",
    "tarfile",
    "tokenize",
    "traceback",
    "urllib.parse",
    "uuid",
    "wave",
    "zipfile",
    "calendar",
    "configparser",
    "fractions",
    "glob",
    "posixpath",
    "shutil",
    "tempfile",
    "timeit",
    "dataclasses",
]
_CODE_ASKS = [
    "Here is a Python function. Give back the whole function unchanged except that "
    "the variable `{old}` is renamed to `{new}`. Reply with the code only.\n\n```python\n"
    "{code}```",
    "Add type hints to this Python function and give it back whole. Reply with the code "
    "only.\n\n```python\n{code}```",
    "Explain what this Python function does, step by step.\n\n```python\n{code}```",
    "Complete this Python function. Reply with the code only.\n\n```python\n{head}```",
]


def code_prompts(n: int, seed: int, skip: int = 0) -> list[str]:
    """Coding requests over standard-library functions (none of the edit workload's)."""
    edit_funcs = {q for _, q in EDIT_SOURCES}
    funcs: list[Any] = []
    for name in _CODE_MODULES:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isfunction):
            if obj.__module__ == name and obj.__qualname__ not in edit_funcs:
                funcs.append(obj)
    rng = random.Random(seed)
    rng.shuffle(funcs)
    out: list[str] = []
    for i, fn in enumerate(funcs):
        try:
            code = inspect.cleandoc(inspect.getsource(fn)) + "\n"
        except (OSError, TypeError):
            continue
        if not 80 <= len(code) <= 2500:
            continue
        names = [v for v in fn.__code__.co_varnames if len(v) > 3]
        ask = _CODE_ASKS[i % len(_CODE_ASKS)]
        if "{old}" in ask and not names:
            ask = _CODE_ASKS[2]
        doc_end = code.find('"""', code.find('"""') + 3)
        head = code[: doc_end + 3] + "\n" if doc_end > 0 else code.split("\n")[0] + "\n"
        old = names[0] if names else ""
        out.append(ask.format(old=old, new=f"{old}_value", code=code, head=head))
        if len(out) == skip + n:
            break
    return out[skip:]


def chat_prompts(
    tokenizer: Any, sharegpt: int, code: int, seed: int, skip: int = 0, code_skip: int = 0
) -> list[list[int]]:
    """Chat-formatted prompts: `sharegpt` ShareGPT first turns after the first `skip`,
    and `code` coding requests after the first `code_skip` (a second file of other
    prompts)."""
    bench = set(sharegpt_prompts(_BENCH_SHAREGPT, seed=0))
    pool = sharegpt_prompts(skip + sharegpt + _BENCH_SHAREGPT, seed=seed)
    shared = [t for t in pool if t not in bench]
    texts = shared[skip : skip + sharegpt] + code_prompts(code, seed, code_skip)
    ids = [chat_ids(tokenizer, t) for t in texts]
    return [p for p in ids if len(p) <= 512]


def features(llm: LLM, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's final-normed hidden state at every position of each sequence."""
    engine = llm.engine
    runner, kv = engine.runner, engine.kv
    captured: list[torch.Tensor] = []
    hook = runner.model.register_forward_hook(lambda m, a, out: captured.append(out))
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for i, ids in enumerate(seqs):
            req = Request(f"features-{i}", ids, SamplingParams(temperature=0, max_tokens=1))
            assert kv.allocate_slots(req, len(ids)), "the KV pool is too small"
            captured.clear()
            runner.execute([(req, len(ids))])
            kv.free(req)
            with torch.inference_mode():
                feats = runner.model.norm(captured[0]).to(torch.bfloat16)
            out.append((torch.tensor(ids, dtype=torch.int32), feats.clone()))
    finally:
        hook.remove()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sharegpt", type=int, default=1200)
    ap.add_argument("--code", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip", type=int, default=0, help="ShareGPT prompts to pass over")
    ap.add_argument("--code-skip", type=int, default=0, help="coding prompts to pass over")
    args = ap.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False)
    prompts = chat_prompts(
        llm.tokenizer, args.sharegpt, args.code, args.seed, args.skip, args.code_skip
    )
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    outs = llm.generate(prompts, params)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    print(f"{sum(map(len, seqs))} tokens in all", flush=True)
    torch.save(features(llm, seqs), args.out)


if __name__ == "__main__":
    main()
