"""Tensor parallelism (`tensor_parallel_size=2`): the same greedy tokens as one rank
(fp32) on random Qwen2 and Qwen3 models, over both all-reduces, and on a GGUF file's
quantized blocks; the number of
collectives per step the design names; the shared-memory all-reduce against a plain
sum; block-quantized shards against their dense slices; refusals naming the field; a
dead worker raising instead of hanging.

Each engine with TP=2 starts a worker process (~5-10 s on two busy cores), so `make
test` runs one combination per architecture; the others, the real model and the
fault test are `make test-dist`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from benchmarks.random_gguf import hf_to_gguf
from sluice import LLM, SamplingParams
from sluice.config import EngineConfig
from sluice.core.errors import ConfigError, TensorParallelError
from sluice.core.quantized_tensor import QuantizedTensor, dequantize, pack
from sluice.layers.block_quant import BlockQuantized
from sluice.loader import tokenizer_from_gguf
from sluice.models.tp_shard import _columns, _padded_rows, local_config, shard_checkpoint
from sluice.parallel.shm import ShmCollectives, create_segment

LAYERS = 3
COMMON = dict(
    vocab_size=49152,  # the SmolLM2 tokenizer is reused for detokenization
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,  # peaky logits: no near-ties for greedy to trip on
    bos_token_id=1,
    eos_token_id=2,
)


def build(kind: str, directory: Path, smollm2_path: Path) -> None:
    """A random model saved as a Hugging Face directory. Qwen2 with its q/k/v biases
    made to matter and a separate head; Qwen3 (QK-norm, head_dim 48) with a tied one."""
    torch.manual_seed(0)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=False)
    else:
        config = transformers.Qwen3Config(
            **COMMON, head_dim=48, rope_theta=1e6, tie_word_embeddings=True
        )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(directory)
    tokenizer_from_gguf(smollm2_path).save(directory)


PROMPT_LENGTHS = (5, 23, 40)


def greedy(llm: LLM) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    sp = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def engine(path: Path, tp: int, **options: object) -> LLM:
    return LLM(
        model=str(path),
        dtype="float32",
        kv_cache_memory=0.02,
        max_num_batched_tokens=32,  # the 40-token prompt is prefilled in two chunks
        block_size=8,
        num_threads=2,
        tensor_parallel_size=tp,
        **options,
    )


def check_collectives_per_step(llm: LLM) -> None:
    """The design's count: per forward pass 2 all-reduces a layer (after o_proj and
    down_proj) + 1 for the vocab-parallel embedding; 1 gather of the head's slices."""
    group = llm.engine.tp_group
    assert group is not None
    llm.engine.add_request("count", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2))
    for _ in range(2):  # the prefill step, then a decode step
        group.reset_stats()
        llm.engine.step()
        stats = group.reset_stats()
        assert (stats.all_reduces, stats.gathers) == (2 * LAYERS + 1, 1)
    assert not llm.engine.has_unfinished_requests()


def run_tp_against_tp1(
    kind: str, allreduce: str, tmp_path: Path, smollm2_path: Path, mp: pytest.MonkeyPatch
) -> None:
    build(kind, tmp_path, smollm2_path)
    one = engine(tmp_path, 1)
    expected = greedy(one)
    del one
    mp.setenv("SLUICE_TP_ALLREDUCE", allreduce)
    two = engine(tmp_path, 2)
    try:
        assert two.engine.tp_group is not None
        assert two.engine.tp_group.spec.allreduce == allreduce
        assert greedy(two) == expected
        check_collectives_per_step(two)
        workers = two.engine.tp_workers
        assert workers is not None
        processes = list(workers.processes)
    finally:
        two.shutdown()
    assert not any(p.is_alive() for p in processes)


@pytest.mark.parametrize(("kind", "allreduce"), [("qwen2", "shm"), ("qwen3", "gloo")])
def test_tp2_greedy_equals_tp1(
    kind: str, allreduce: str, tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_tp_against_tp1(kind, allreduce, tmp_path, smollm2_path, monkeypatch)


def test_tp2_on_gguf_blocks_equals_tp1(tmp_path: Path, smollm2_path: Path) -> None:
    """A GGUF file's Q4_0 blocks split over two ranks: every shard of every linear stays
    blocks on our kernels (o_proj's and down_proj's input halves, 64 and 128 columns,
    fall on 64-value pairs), and the greedy tokens equal one rank's on the same file."""
    build("qwen2", tmp_path / "hf", smollm2_path)
    path = tmp_path / "qwen2-q4_0.gguf"
    hf_to_gguf(tmp_path / "hf", path, tensor_type="Q4_0", tokenizer_gguf=smollm2_path)
    one = engine(path, 1, quantization="gguf")
    expected = greedy(one)
    del one
    two = engine(path, 2, quantization="gguf")
    try:
        assert two.engine.tp_group is not None
        for layer in two.engine.runner.model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj):  # fmt: skip
                assert isinstance(linear.method, BlockQuantized), linear
        assert greedy(two) == expected
    finally:
        two.shutdown()


def test_tp2_with_lora_adapters_equals_tp1(tmp_path: Path, smollm2_path: Path) -> None:
    """Two adapters and the base in one batch over two ranks: each rank holds its part
    of each adapter (B's rows of its q/k/v and gate/up outputs and of its vocabulary
    slice of the head, A's columns of its o and down inputs and A^T's rows of its
    slice of the embedding, whose partial products the all-reduce sums with the
    base's), put in the slots rank 0 chose; greedy tokens equal one rank's, and the
    adapters act."""
    from benchmarks.random_models import write_random_adapter
    from sluice import LoRARequest

    build("qwen2", tmp_path / "hf", smollm2_path)
    one = engine(tmp_path / "hf", 1, enable_lora=True, max_loras=2)
    folders = [
        write_random_adapter(
            one.engine.model_config, 8, seed, tmp_path / f"a{seed}", 0.5, model_level=seed == 2
        )
        for seed in (1, 2)
    ]
    loras = [LoRARequest("a", 1, str(folders[0])), None, LoRARequest("b", 2, str(folders[1]))]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    sp = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)

    def tokens(llm: LLM, lora: list[Any]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=lora)]

    expected = tokens(one, loras)
    assert expected != tokens(one, [None] * 3)  # the adapters change the answers
    del one
    two = engine(tmp_path / "hf", 2, enable_lora=True, max_loras=2)
    try:
        assert tokens(two, loras) == expected
    finally:
        two.shutdown()


@pytest.mark.dist
@pytest.mark.parametrize(("kind", "allreduce"), [("qwen2", "gloo"), ("qwen3", "shm")])
def test_tp2_greedy_equals_tp1_other_allreduce(
    kind: str, allreduce: str, tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_tp_against_tp1(kind, allreduce, tmp_path, smollm2_path, monkeypatch)


@pytest.mark.dist
def test_dead_worker_raises(tmp_path: Path, smollm2_path: Path) -> None:
    build("qwen2", tmp_path, smollm2_path)
    llm = engine(tmp_path, 2)
    try:
        workers = llm.engine.tp_workers
        assert workers is not None
        pid = workers.processes[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        workers.processes[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError):
            greedy(llm)
        assert time.monotonic() - t0 < 30
    finally:
        llm.shutdown()


@pytest.mark.dist
def test_real_model_tp2_equals_tp1() -> None:
    """Qwen2.5-Coder-0.5B (14 heads, 2 KV heads), fp32 and unquantized: exact mode."""
    from sluice.core.errors import ModelNotFoundError
    from sluice.loader import resolve_model_path

    try:
        resolve_model_path("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    prompts = ["def quicksort(arr):", "The capital of France is"]
    sp = SamplingParams(temperature=0, max_tokens=24)
    opts = dict(dtype="float32", quantization="none", kv_cache_memory=0.25, max_model_len=512)
    one = LLM("qwen2.5-coder-0.5b", **opts)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    del one
    two = LLM("qwen2.5-coder-0.5b", tensor_parallel_size=2, **opts)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, sp, use_tqdm=False)]
    finally:
        two.shutdown()
    assert got == expected


# ---- refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(tensor_parallel_size=0),
        dict(tensor_parallel_size=2, data_parallel_size=2),
        dict(tensor_parallel_size=2, compile=True),
        dict(tensor_parallel_size=2, kv_offload_dir="/tmp/x"),
    ],
)
def test_bad_combinations_name_the_field(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**options)  # type: ignore[arg-type]
    assert info.value.param == "tensor_parallel_size"


def test_smollm2_cannot_split_over_two() -> None:
    """9 query / 3 KV heads: refused before any worker starts."""
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 must divide") as info:
        LLM(tensor_parallel_size=2, kv_cache_memory=0.02)
    assert info.value.param == "tensor_parallel_size"


# ---- the shared-memory all-reduce -------------------------------------------------


def on_ranks(
    tmp_path: Path, world: int, slot_bytes: int, body: Callable[[ShmCollectives], object]
) -> list[object]:
    """Run `body` on `world` ranks (threads; each its own ShmCollectives on one segment)."""
    path = str(tmp_path / "seg")
    create_segment(path, world, slot_bytes)
    results: list[object] = [None] * world

    def rank(r: int) -> None:
        shm = ShmCollectives(path, r, world, slot_bytes, timeout_s=30)
        results[r] = body(shm)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    # Ranks are processes in the engine; here they are threads, and a spinning rank
    # holds the GIL for a whole switch interval (5 ms) while the others wait for it.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 100, 1000])  # 1000 values: several slot-sized pieces
def test_shm_all_reduce_is_the_sum(tmp_path: Path, dtype: torch.dtype, numel: int) -> None:
    world = 3
    gen = torch.Generator().manual_seed(numel)
    inputs = [torch.randn(numel, generator=gen).to(dtype) for _ in range(world)]

    def body(shm: ShmCollectives) -> object:
        outs = []
        for _ in range(3):  # repeated calls reuse both slots
            x = inputs[shm.rank].clone().view(-1, 1) if numel > 1 else inputs[shm.rank].clone()
            outs.append(shm.all_reduce(x).view(-1))
        return outs

    results = on_ranks(tmp_path, world, 256, body)
    expected = (inputs[0].float() + inputs[1].float() + inputs[2].float()).to(dtype)
    for outs in results:
        assert isinstance(outs, list)
        for out in outs:
            torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_shm_gather_to_rank0(tmp_path: Path) -> None:
    world = 2
    inputs = [torch.arange(300, dtype=torch.float32).view(3, 100) + 1000 * r for r in range(world)]
    results = on_ranks(tmp_path, world, 128, lambda shm: shm.gather(inputs[shm.rank]))
    parts = results[0]
    assert isinstance(parts, list)
    for got, want in zip(parts, inputs, strict=True):
        assert torch.equal(got, want)
    assert results[1] is None


def test_shm_wait_times_out(tmp_path: Path) -> None:
    path = str(tmp_path / "seg")
    create_segment(path, 2, 64)
    shm = ShmCollectives(path, 0, 2, 64, timeout_s=0.2)
    with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] did not reach"):
        shm.all_reduce(torch.ones(4))
    shm = ShmCollectives(path, 0, 2, 64, timeout_s=30, alive=lambda: False)
    with pytest.raises(TensorParallelError, match="died"):
        shm.all_reduce(torch.ones(4))


# ---- sharding -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bits", "group", "symmetric"),
    [(4, 32, False), (5, 32, False), (6, 16, True), (6, 32, False), (8, 32, False), (8, 16, True)],
)
def test_quantized_column_shards_stay_blocks(bits: int, group: int, symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(bits + group)
    n, k = 6, 256
    u = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen)
    minimum = None if symmetric else torch.randn(n, k // group, generator=gen)
    w = pack(u, scale, minimum, bits, group)
    dense = dequantize(w)
    for start, stop in ((0, 128), (128, 256), (64, 192)):
        part = _columns(w, start, stop, "w", torch.float32)
        assert not isinstance(part, torch.Tensor)  # still blocks
        assert torch.equal(dequantize(part), dense[:, start:stop])
    # Not on a 64-value pair: that shard is dequantized.
    part = _columns(w, 32, 160, "w", torch.float32)
    assert isinstance(part, torch.Tensor)
    assert torch.equal(part, dense[:, 32:160])


@pytest.mark.parametrize("symmetric", [False, True])
def test_integer_scale_column_shards(symmetric: bool) -> None:
    # The K-quants' integer scales: a cut on 256-value super-blocks keeps them (exact);
    # on a pair only, the shard takes float16 scales and stays blocks.
    gen = torch.Generator().manual_seed(3)
    n, k, group = 6, 768, 16
    u = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.randint(-127, 128, (n, k // group), generator=gen)
    minimum = None if symmetric else torch.randint(-127, 128, (n, k // group), generator=gen)
    mult = (torch.rand(n, 1 if symmetric else 2, k // 256, generator=gen) * 1e-3).half()
    w = pack(u, scale, minimum, 6, group, "Q6_K", mult)
    dense = dequantize(w)
    part = _columns(w, 256, 768, "w", torch.float32)
    assert isinstance(part, QuantizedTensor) and part.integer_scales
    assert torch.equal(dequantize(part), dense[:, 256:768])
    part = _columns(w, 64, 320, "w", torch.float32)
    assert isinstance(part, QuantizedTensor) and not part.integer_scales
    expected = dequantize(w.with_float_scales())[:, 64:320]
    assert torch.equal(dequantize(part), expected)


def test_vocab_slices_pad_with_zeros() -> None:
    w = torch.randn(10, 4)
    last = _padded_rows(w, 8, 5)  # a 10-row vocabulary over 2 ranks of 5: rows 8, 9 + 3 zeros
    assert isinstance(last, torch.Tensor)
    assert torch.equal(last[:2], w[8:]) and not last[2:].any()
    q = pack(
        torch.randint(0, 16, (10, 64), dtype=torch.uint8),
        torch.rand(10, 2),
        torch.rand(10, 2),
        4,
        32,
    )
    part = _padded_rows(q, 8, 5)
    assert not isinstance(part, torch.Tensor)
    assert torch.equal(dequantize(part)[:2], dequantize(q)[8:]) and not dequantize(part)[2:].any()
    # Integer scales pad their multipliers too.
    qi = pack(
        q.packed.new_zeros(10, 256) + 3, torch.ones(10, 8), None, 4, 32, "", torch.ones(10, 1, 1)
    )
    part = _padded_rows(qi, 8, 5)
    assert isinstance(part, QuantizedTensor) and part.super_scale.shape == (5, 1, 1)
    assert torch.equal(dequantize(part)[:2], dequantize(qi)[8:]) and not dequantize(part)[2:].any()


def test_shard_checkpoint_shapes() -> None:
    from sluice.config import ModelConfig

    # vocab 11, hidden 8, intermediate 12, 1 layer, 4 heads, 2 KV heads, head_dim 2
    mc = ModelConfig("qwen2", 11, 8, 12, 1, 4, 2, 2, attention_bias=True)
    p = "model.layers.0."
    names = {
        "model.embed_tokens.weight": (11, 8),
        "lm_head.weight": (11, 8),
        p + "self_attn.q_proj.weight": (8, 8),
        p + "self_attn.q_proj.bias": (8,),
        p + "self_attn.k_proj.weight": (4, 8),
        p + "self_attn.o_proj.weight": (8, 8),
        p + "mlp.up_proj.weight": (12, 8),
        p + "mlp.down_proj.weight": (8, 12),
        p + "input_layernorm.weight": (8,),
    }
    tensors: dict[str, torch.Tensor] = {n: torch.randn(s) for n, s in names.items()}
    full = dict(tensors)
    shard_checkpoint(tensors, mc, 1, 2, torch.float32)  # type: ignore[arg-type]
    assert tensors["model.embed_tokens.weight"].shape == (6, 8)  # 5 rows + 1 of padding
    for name, rows_or_cols in (
        ("self_attn.q_proj.weight", (slice(4, 8), slice(None))),
        ("self_attn.q_proj.bias", (slice(4, 8),)),
        ("self_attn.k_proj.weight", (slice(2, 4), slice(None))),
        ("self_attn.o_proj.weight", (slice(None), slice(4, 8))),
        ("mlp.up_proj.weight", (slice(6, 12), slice(None))),
        ("mlp.down_proj.weight", (slice(None), slice(6, 12))),
    ):
        assert torch.equal(tensors[p + name], full[p + name][rows_or_cols]), name
    assert tensors[p + "input_layernorm.weight"] is full[p + "input_layernorm.weight"]
    local = local_config(mc, 2)
    shapes = (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size)
    assert shapes == (2, 1, 6, 6)


@pytest.mark.parametrize("kind", ["qwen2moe", "gpt_oss"])
def test_expert_parallel_greedy_equals_one_rank(
    kind: str, tmp_path: Path, smollm2_path: Path
) -> None:
    """`enable_expert_parallel`: each of 2 ranks holds 4 of the 8 experts (attention split
    by heads as without it); the greedy tokens are one rank's, Qwen2-MoE's replicated
    shared expert added once; per step still 2 all-reduces a layer. gpt-oss brings its
    experts' biases (whole experts a rank), its heads' sinks, the output projection's
    bias (added once) and its windowed layers."""
    from benchmarks.random_models import SMALL, build_model

    build_model(kind, SMALL, tmp_path)
    tokenizer_from_gguf(smollm2_path).save(tmp_path)
    expected = greedy(engine(tmp_path, 1))
    with pytest.raises(ConfigError, match="set enable_expert_parallel"):
        engine(tmp_path, 2)
    two = LLM(
        model=str(tmp_path),
        dtype="float32",
        kv_cache_memory=0.02,
        max_num_batched_tokens=32,
        block_size=8,
        num_threads=2,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
    try:
        assert greedy(two) == expected
        check_collectives_per_step(two)  # SMALL has LAYERS layers too
        # Rank 0 reports its own experts' load: 4 of the 8.
        assert {len(row) for row in two.stats()["moe_expert_tokens"]} == {4}
    finally:
        two.shutdown()
