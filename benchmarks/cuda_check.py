"""The CUDA path end to end, on a machine with a GPU: correctness against transformers,
then figures side by side.

sluice is CPU first, but the engine is device-agnostic (`device="cuda"`): the dense
layers, SDPA over the paged KV cache, the sampler and the scheduler run unchanged on a
GPU. No CI machine has one, so this script is what checks that path where a GPU is lent:

1. correctness: small random-weight Llama, Qwen2 and Qwen3 models (the shapes of
   tests/test_architectures.py) on the GPU in fp32, sluice's greedy output against
   transformers' on the same weights, token for token, with chunked prefill (a 32-token
   budget), prefix caching, and again with n-gram and draft-model speculative decoding;
   The MoE kinds (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) the same way, plain and with
   n-gram speculation (part "moe"): routing, grouping and dense expert stacks on the GPU;
2. figures: a random-weight model of SmolLM2-135M's shape in bf16, single-stream
   decode and offline throughput against transformers' static-batch `generate` on the
   same weights and prompts, interleaved rounds (A B A B), medians;
3. the server: `sluice serve --device cuda` answers a completion, a streamed one and
   /metrics, and refuses a bad request with a 400;
4. torch.compile: greedy still equal to transformers, and single-stream decode eager
   against compiled.

The weights are random (no model file fits the GPU lease's upload), so the outputs are
not text; only the shapes, and so the time a step takes, are SmolLM2's.

Run (the tokenizer directory holds tokenizer.json; any sluice-readable one serves):
    python -m benchmarks.cuda_check --tokenizer DIR --output result.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO_ROOT, compare, interleave, output_path, write_result
from benchmarks.random_models import MOE_KINDS, SMALL, build_model, write_random_adapter

# SmolLM2-135M's shape (30 layers, hidden 576, GQA 9/3, vocab 49152, tied embeddings).
SMOLLM2_SHAPE = dict(
    SMALL,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    initializer_range=0.02,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)


def build(kind: str, shape: dict[str, Any], directory: Path, tokenizer: Path) -> Any:
    """A random-weight model saved with the tokenizer's files beside it."""
    model = build_model(kind, shape, directory)
    for f in tokenizer.iterdir():
        shutil.copy(f, directory / f.name)
    return model


def hf_greedy(model: Any, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            outs.append(y[0, len(ids) :].tolist())
    return outs


GREEDY_TOKENS = 24


def small_prompts() -> list[list[int]]:
    """Seeded random prompts of 5-70 tokens (70: three chunks of a 32-token budget)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 23, 40, 70)]


def small_engine(directory: Path, device: str, **options: Any) -> Any:
    """fp32, a 32-token step budget (chunked prefill) and blocks of 8 tokens."""
    from sluice import LLM

    return LLM(
        model=str(directory),
        device=device,
        dtype="float32",
        kv_cache_memory=0.05,
        max_num_batched_tokens=32,
        block_size=8,
        **options,
    )


def greedy_against(llm: Any, prompts: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    """sluice's greedy tokens against transformers' `ref`: prompts and leading tokens equal."""
    from sluice import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, min_tokens=GREEDY_TOKENS)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    equal = [o == r for o, r in zip(outs, ref, strict=True)]
    same = sum(
        next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), len(r))
        for o, r in zip(outs, ref, strict=True)
    )
    return {
        "prompts_equal": sum(equal),
        "prompts": len(prompts),
        "leading_tokens_equal": same,
        "tokens": GREEDY_TOKENS * len(prompts),
        "ok": all(equal),
    }


def check_correctness(
    tokenizer: Path,
    device: str,
    work: Path,
    kinds: tuple[str, ...] = ("llama", "qwen2", "qwen3"),
    methods: tuple[str | None, ...] = (None, "ngram", "draft"),
) -> list[dict[str, Any]]:
    """Greedy output of each kind's random model on `device` against transformers'
    there, plain and with each speculative method. The MoE kinds (part "moe") run
    their experts as dense stacks on the GPU (routing, grouping and the weighted sum
    in torch)."""
    from sluice.engine.speculative.step_costs import StepCosts

    prompts = small_prompts()
    # A prompt that repeats itself, so n-gram lookup has drafts to verify.
    prompts.append((prompts[1] * 4)[:80])
    results = []
    for kind in kinds:
        directory = work / kind
        model = build(kind, SMALL, directory, tokenizer).to(device)
        ref = hf_greedy(model, prompts, GREEDY_TOKENS, device)
        # "draft": the model drafts for itself, so every draft is accepted and the
        # draft model's own paged KV and catch-up run too.
        for spec in methods:
            llm = small_engine(
                directory,
                device,
                speculative_method=spec,
                speculative_model=str(directory) if spec == "draft" else None,
            )
            if spec is not None:
                # Verify every draft (the cost model would rightly skip most on a model
                # this small): what is checked here is verification and rollback.
                assert llm.engine.speculator is not None
                llm.engine.speculator.costs = StepCosts.uniform(0.0, max_rows=16)
            stats = greedy_against(llm, prompts, ref)
            results.append(
                {
                    "model": kind,
                    "speculative": spec,
                    **stats,
                    "drafted": llm.stats().get("spec_drafted_tokens", 0),
                    "accepted": llm.stats().get("spec_accepted_tokens", 0),
                }
            )
            print(json.dumps(results[-1]), flush=True)
            del llm
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sluice_run(llm: Any, prompts: list[list[int]], n: int) -> dict[str, float]:
    from sluice import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tok_s": produced / dt}


def hf_run(model: Any, prompts: list[list[int]], n: int, batch: int) -> dict[str, float]:
    """transformers' static batches, left-padded; every row makes n tokens."""
    device = next(model.parameters()).device
    sync()
    t0 = time.perf_counter()
    produced = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            rows = prompts[i : i + batch]
            width = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for j, r in enumerate(rows):
                ids[j, width - len(r) :] = torch.tensor(r)
                mask[j, width - len(r) :] = 1
            y = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            produced += (y.shape[1] - width) * len(rows)
    sync()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tok_s": produced / dt}


def smollm2_engine(directory: Path, device: str, **options: Any) -> Any:
    """The SmolLM2-shaped model's engine for the figures: bf16, room for 256 streams,
    no prefix cache (every round runs the same prompts: a prefix cache would skip their
    prefill from the second round on, which transformers cannot)."""
    from sluice import LLM

    return LLM(
        model=str(directory),
        device=device,
        dtype="bfloat16",
        kv_cache_memory=8.0,
        max_num_seqs=256,
        enable_prefix_caching=False,
        **options,
    )


def figures(
    tokenizer: Path, work: Path, rounds: int, n_prompts: int, device: str
) -> dict[str, Any]:
    directory = work / "smollm2-shape"
    model = build("llama", SMOLLM2_SHAPE, directory, tokenizer).to(device, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(32, 512, (n_prompts,), generator=gen).tolist()
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]
    single = [prompts[0][:128]]
    llm = smollm2_engine(directory, device, max_num_batched_tokens=8192)
    out: dict[str, Any] = {"prompts": n_prompts, "prompt_tokens": sum(lengths)}
    for name, batch, n in (("single_stream", None, 256), ("offline", 64, 128)):
        work_prompts = single if batch is None else prompts

        def measure(
            side: str, wp: list[list[int]] = work_prompts, b: int | None = batch, n: int = n
        ) -> dict[str, float]:
            if side == "sluice":
                return sluice_run(llm, wp, n)
            return hf_run(model, wp, n, b or 1)

        for side in ("sluice", "transformers"):  # an untimed round: kernels' first use
            measure(side)
        runs = interleave(["sluice", "transformers"], rounds, measure, label=name)
        out[name] = {
            "output_tokens_per_request": n,
            "hf_batch": batch or 1,
            **compare(runs, ["output_tok_s", "seconds"], baseline="transformers"),
        }
        s = out[name]["summary"]
        print(
            f"{name}: sluice {s['sluice']['output_tok_s']['median']:.0f} tok/s, transformers "
            f"{s['transformers']['output_tok_s']['median']:.0f} tok/s",
            flush=True,
        )
    return out


def lora_greedy(tokenizer: Path, device: str, work: Path) -> dict[str, Any]:
    """fp32 greedy of one batch mixing two random adapters and the base on a small
    random Llama, each row against transformers + peft with its adapter (the base row
    against transformers alone)."""
    import copy

    from peft import PeftModel

    from sluice import LoRARequest, SamplingParams

    directory = work / "lora-llama"
    model = build("llama", SMALL, directory, tokenizer).to(device)
    prompts = small_prompts()
    llm = small_engine(directory, device, enable_lora=True, max_loras=2)
    config = llm.engine.model_config
    requests = [
        LoRARequest(f"a{seed}", seed + 1, str(write_random_adapter(
            config, 8, seed, work / f"lora-{seed}", b_scale=0.5)))
        for seed in (0, 1)
    ]  # fmt: skip
    refs = {None: hf_greedy(model, prompts, GREEDY_TOKENS, device)}
    for r in requests:
        adapted = PeftModel.from_pretrained(copy.deepcopy(model), r.lora_path).to(device).eval()
        refs[r.lora_name] = hf_greedy(adapted, prompts, GREEDY_TOKENS, device)
    choice = [requests[0], None, requests[1], requests[0]]  # one per prompt
    sp = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, min_tokens=GREEDY_TOKENS)
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=choice)
    names = [None if c is None else c.lora_name for c in choice]
    equal = [
        o.outputs[0].token_ids == refs[name][i]
        for i, (o, name) in enumerate(zip(outs, names, strict=True))
    ]
    result = {
        "rows": names,
        "prompts_equal": sum(equal),
        "prompts": len(prompts),
        "adapters_change_output": [refs[r.lora_name] != refs[None] for r in requests],
        "ok": all(equal),
    }
    print(json.dumps(result), flush=True)
    return result


def lora_figures(tokenizer: Path, work: Path, rounds: int, device: str) -> dict[str, Any]:
    """A SmolLM2-shaped bf16 model with rank-16 random adapters on all seven
    projections: one stream's decode with an adapter against the base, and 64 streams
    spread over four adapters and the base against the base alone, interleaved."""
    from sluice import LoRARequest, SamplingParams

    directory = work / "smollm2-shape"
    if not directory.exists():
        build("llama", SMOLLM2_SHAPE, directory, tokenizer)
    llm = smollm2_engine(directory, device, enable_lora=True, max_loras=4)
    config = llm.engine.model_config
    adapters = [
        LoRARequest(f"a{seed}", seed + 1, str(write_random_adapter(
            config, 16, seed, work / f"lora-smollm2-{seed}")))
        for seed in range(4)
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (64,), generator=gen).tolist() for _ in range(64)]

    def run(side: str) -> dict[str, float]:
        one = side.startswith("one")
        rows = prompts[:1] if one else prompts
        if side.endswith("adapter"):
            lora: Any = adapters[0]
        elif side == "mixed":
            lora = [([*adapters, None])[i % 5] for i in range(len(rows))]
        else:
            lora = None
        sp = SamplingParams(temperature=0, max_tokens=256 if one else 128, ignore_eos=True)
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(rows, sp, use_tqdm=False, lora_request=lora)
        sync()
        dt = time.perf_counter() - t0
        return {"output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}

    out: dict[str, Any] = {"adapters": len(adapters), "rank": 16}
    for name, sides in (("single_stream", ["one_base", "one_adapter"]),
                        ("streams_64", ["base", "mixed"])):  # fmt: skip
        for side in sides:  # an untimed round: kernels' first use, adapters' first load
            run(side)
        runs = interleave(sides, rounds, run, label=name)
        out[name] = compare(runs, ["output_tok_s"], baseline=sides[0])
        s = out[name]["summary"]
        rates = (f"{k} {s[k]['output_tok_s']['median']:.0f} tok/s" for k in sides)
        print(f"{name}: " + ", ".join(rates), flush=True)
    return out


def check_compile(tokenizer: Path, work: Path, rounds: int, device: str) -> dict[str, Any]:
    """compile=True: greedy equal to transformers (fp32, small llama), and single-stream
    decode of the SmolLM2-shaped model, eager against compiled, interleaved."""
    from sluice import LLM

    directory = work / "llama-compile"
    model = build("llama", SMALL, directory, tokenizer).to(device)
    prompts = small_prompts()
    ref = hf_greedy(model, prompts, GREEDY_TOKENS, device)
    t0 = time.perf_counter()
    llm = small_engine(directory, device, compile=True)
    out: dict[str, Any] = {
        **greedy_against(llm, prompts, ref),
        "first_generate_seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out), flush=True)
    del llm
    shaped = work / "smollm2-shape"
    if not shaped.exists():  # the figures part builds it; alone, this part does
        build("llama", SMOLLM2_SHAPE, shaped, tokenizer)
    single = [torch.randint(3, 49152, (128,), generator=torch.Generator().manual_seed(3)).tolist()]
    engines = {
        side: LLM(
            model=str(shaped),
            device=device,
            dtype="bfloat16",
            kv_cache_memory=1.0,
            compile=side == "compiled",
            enable_prefix_caching=False,
        )
        for side in ("eager", "compiled")
    }
    for llm in engines.values():
        sluice_run(llm, single, 16)  # compiles the decode shapes
    runs = interleave(
        list(engines), rounds, lambda side: sluice_run(engines[side], single, 256), label="compile"
    )
    out["single_stream"] = compare(runs, ["output_tok_s", "seconds"], baseline="eager")
    s = out["single_stream"]["summary"]
    print(
        f"compile: eager {s['eager']['output_tok_s']['median']:.0f} tok/s, compiled "
        f"{s['compiled']['output_tok_s']['median']:.0f} tok/s",
        flush=True,
    )
    return out


def check_server(work: Path, tokenizer: Path, device: str, port: int = 8011) -> dict[str, Any]:
    directory = work / "llama"
    if not directory.exists():  # the correctness part builds it; alone, this part does
        build("llama", SMALL, directory, tokenizer)
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [
        sys.executable,
        "-m",
        "sluice.cli",
        "serve",
        "--model",
        str(directory),
        "--device",
        device,
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--kv-cache-memory",
        "0.1",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {}
    try:
        for _ in range(240):
            if proc.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:  # not a refused request below: its log (kept in `finally`) says why
            raise RuntimeError("sluice serve did not answer /health in 240 tries")
        body = {"model": str(directory), "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}

        def post(payload: dict[str, Any]) -> tuple[int, str]:
            req = urllib.request.Request(
                base + "/v1/completions",
                json.dumps(payload).encode(),
                {"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        status, text = post(body)
        result["completion"] = {"status": status, "usage": json.loads(text).get("usage")}
        status, text = post({**body, "stream": True})
        result["stream"] = {"status": status, "events": text.count("data: ")}
        status, text = post({**body, "max_tokens": -1})
        result["bad_request"] = {"status": status, "error": json.loads(text).get("error")}
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        result["metrics_lines"] = [ln for ln in metrics.splitlines() if "generation_tokens" in ln][
            :3
        ]
        result["ok"] = (
            result["completion"]["status"] == 200
            and result["stream"]["status"] == 200
            and result["bad_request"]["status"] == 400
        )
    except Exception:  # keep the server's own log with the error
        result["error"] = traceback.format_exc()
        result["ok"] = False
    finally:
        proc.terminate()
        try:
            log, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
        result["log_tail"] = log.splitlines()[-40 if not result.get("ok") else -8 :]
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=256, help="offline throughput prompts")
    ap.add_argument(
        "--parts",
        default="correctness,moe,lora,server,figures,lora_figures,compile",
        help="which parts, in order",
    )
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    ap.add_argument(
        "--output", type=output_path, default=REPO_ROOT / "benchmarks/results/cuda_check.json"
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("cuda_check needs a CUDA GPU (torch.cuda.is_available() is False)")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    payload: dict[str, Any] = {"gpu": gpu, "device": args.device}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, step in (
            ("correctness", lambda: check_correctness(args.tokenizer, args.device, work)),
            (
                "moe",
                lambda: check_correctness(
                    args.tokenizer, args.device, work, MOE_KINDS, (None, "ngram")
                ),
            ),
            ("lora", lambda: lora_greedy(args.tokenizer, args.device, work)),
            ("server", lambda: check_server(work, args.tokenizer, args.device)),
            (
                "figures",
                lambda: figures(args.tokenizer, work, args.rounds, args.prompts, args.device),
            ),
            ("lora_figures", lambda: lora_figures(args.tokenizer, work, args.rounds, args.device)),
            ("compile", lambda: check_compile(args.tokenizer, work, args.rounds, args.device)),
        ):
            if name not in args.parts.split(","):
                continue
            t0 = time.perf_counter()
            try:
                payload[name] = step()
            except Exception:  # record and go on: a later part may still tell something
                payload[name] = {"error": traceback.format_exc()}
                print(payload[name]["error"], flush=True)
            payload[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
            write_result("cuda_check", payload, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
