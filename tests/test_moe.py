"""Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE,
GraniteMoeShared and gpt-oss, whose sinks, windows, YaRN and biases ride along) on
random weights:
sluice's greedy output equals transformers' token for token in fp32, from the
safetensors directory, alone and batched, in chunks and after a prefix-cache hit;
routing ties break as the reference breaks them; a bad checkpoint is refused by name.
The GGUF path of the same models is tests/test_moe_gguf.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.random_models import MOE_KINDS, SMALL, build_model
from sluice import LLM, SamplingParams
from sluice.loader import tokenizer_from_gguf

ARCHITECTURE = {
    "mixtral": "llama",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
    "olmoe": "olmoe",
    "granitemoe": "granitemoe",
    "granitemoeshared": "granitemoe",
    "gpt_oss": "gpt_oss",
}


def build(kind: str, directory: Path, smollm2_path: Path) -> Any:
    model = build_model(kind, SMALL, directory)
    tokenizer_from_gguf(smollm2_path).save(directory)
    return model


def reference(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return list(out[0, len(ids) :].tolist())


def prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def engine(directory: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(
        model=str(directory), dtype="float32", kv_cache_memory=0.02, block_size=8
    )
    return LLM(**{**options, **kwargs})


GREEDY = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_greedy_equals_transformers_alone_batched_and_chunked(
    kind: str, tmp_path: Path, smollm2_path: Path
) -> None:
    model = build(kind, tmp_path, smollm2_path)
    batch = prompts((5, 23, 40, 70))
    want = [reference(model, ids, 16) for ids in batch]
    # 16-token chunks: the 70-token prompt is prefilled in five steps, beside decodes.
    llm = engine(tmp_path, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert llm.engine.model_config.architecture == ARCHITECTURE[kind]
    assert llm.engine.model_config.num_experts == 8
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    alone = llm.generate(batch[3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == want[3]
    # Every expert of every layer was routed tokens, counted once per (token, expert).
    table = llm.stats()["moe_expert_tokens"]
    k = llm.engine.model_config.num_experts_per_tok
    assert len(table) == SMALL["num_hidden_layers"] and all(len(r) == 8 for r in table)
    computed = sum(len(ids) + 15 for ids in batch) + len(batch[3]) + 15
    assert all(sum(row) == computed * k for row in table)


def test_a_prefix_cache_hit_gives_the_same_tokens(tmp_path: Path, smollm2_path: Path) -> None:
    model = build("qwen3moe", tmp_path, smollm2_path)
    (shared,) = prompts((48,))
    first, second = shared + prompts((9,), seed=2)[0], shared + prompts((6,), seed=3)[0]
    llm = engine(tmp_path, enable_prefix_caching=True)
    llm.generate(first, GREEDY, use_tqdm=False)
    out = llm.generate(second, GREEDY, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] >= 40  # the shared blocks were reused
    assert out.outputs[0].token_ids == reference(model, second, 16)


def test_routing_ties_break_as_the_reference_breaks_them(
    tmp_path: Path, smollm2_path: Path
) -> None:
    """Experts 1, 4 and 6 of every layer get the same router row: every token scores
    them equally, so which of them make its top k is decided by the tie order
    (torch.topk's, as transformers uses it) and the output depends on it: the three
    experts' weights differ."""
    model = build("qwen3moe", tmp_path, smollm2_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            router = layer.mlp.gate.weight
            router[4].copy_(router[1])
            router[6].copy_(router[1])
            router[1].mul_(3.0)  # and make the tied experts often win
            router[4].copy_(router[1])
            router[6].copy_(router[1])
            tensors[f"model.layers.{i}.mlp.gate.weight"] = router.clone()
    save_file(tensors, path, metadata={"format": "pt"})
    batch = prompts((12, 30))
    llm = engine(tmp_path)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference(model, ids, 16) for ids in batch]
    # The ties were real: those experts were chosen, and not equally often.
    table = llm.stats()["moe_expert_tokens"]
    assert any(row[1] != row[6] for row in table)


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(
    tmp_path: Path, smollm2_path: Path
) -> None:
    build("olmoe", tmp_path, smollm2_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.up_proj.*missing \[5\]"):
        engine(tmp_path)


def _u8(*shape: int, fill: int = 0) -> torch.Tensor:
    return torch.full(shape, fill, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        # MXFP4 experts (the released checkpoints') that do not fit, or lack a half.
        (
            lambda t: t.update(
                {
                    "model.layers.0.mlp.experts.gate_up_proj_blocks": _u8(8, 96, 4, 16),
                    "model.layers.0.mlp.experts.gate_up_proj_scales": _u8(8, 96, 4),
                }
            ),
            r"gate_up_proj_blocks holds 768 rows of 128 values; the config's 8 experts of "
            r"64 units \(hidden size 128\) need 1024 rows of 128",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.2.mlp.experts.down_proj_blocks": _u8(8, 128, 2, 16),
                    "model.layers.2.mlp.experts.down_proj_scales": _u8(8, 128, 2, fill=255),
                }
            ),
            r"down_proj_scales: MXFP4 block scale.* beyond float16's range",
        ),
        (
            lambda t: t.update({"model.layers.1.mlp.experts.down_proj_blocks": _u8(8, 128, 2, 16)}),
            r"down_proj_blocks but no model\.layers\.1\.mlp\.experts\.down_proj_scales",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.1.mlp.experts.down_proj_blocks": _u8(8, 128, 2, 16),
                    "model.layers.1.mlp.experts.down_proj_scales": _u8(8, 128, 3),
                }
            ),
            r"down_proj_scales has shape \[8, 128, 3\]; its blocks \[8, 128, 2, 16\] need "
            r"\[8, 128, 2\]",
        ),
        (
            lambda t: t.update({"model.layers.2.self_attn.sinks": torch.zeros(3)}),
            r"model\.layers\.2\.self_attn\.sinks\.weight has shape \(3,\), expected \(4,\)",
        ),
        (
            lambda t: t.update({"model.layers.1.mlp.experts.down_proj_bias": torch.zeros(8, 7)}),
            r"down_proj_bias has shape \[8, 7\]; the config's 8 experts .* need \[8, 128\]",
        ),
        (
            lambda t: t.pop("model.layers.1.mlp.router.bias"),
            r"missing tensor 'model\.layers\.1\.mlp\.gate\.bias'",
        ),
    ],
)
def test_a_gpt_oss_checkpoint_that_does_not_fit_is_refused_naming_the_tensor(
    change: Any, error: str, tmp_path: Path, smollm2_path: Path
) -> None:
    build("gpt_oss", tmp_path, smollm2_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=error):
        engine(tmp_path)


def _as_released_mxfp4(model: Any, directory: Path) -> None:
    """The saved gpt-oss with random MXFP4 experts in place of its float ones, stored as
    the released checkpoints store them (X_blocks [E, rows, K / 32, 16] and X_scales
    [E, rows, K / 32], rows out by in), and `model` given their values as transformers
    itself dequantizes them (convert_moe_packed_tensors): the reference."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = directory / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(7)
    for n, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # [E, in, out]
            e, k, rows = param.shape
            blocks = torch.randint(0, 256, (e, rows, k // 32, 16), generator=gen)
            # |W| up to 6 * 2**-4: the random model's own weights' scale.
            scales = torch.randint(119, 124, (e, rows, k // 32), generator=gen)
            blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            name = f"model.layers.{n}.mlp.experts.{proj}"
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_loads_them_as_stored(
    tmp_path: Path, smollm2_path: Path
) -> None:
    """The released checkpoints' form: fp32 greedy equals transformers token for token
    (the experts dequantized), and on the block kernels the experts stay 4-bit codes
    whose values are exactly transformers' dequantized ones (every expert's gate rows,
    then its up rows: the interleaved gate_up split right), each prompt's next-token
    distribution the dense run's to the int8 activations' rounding (as the GGUF files'
    MXFP4 experts in test_moe_gguf.py)."""
    from sluice.core.quantized_tensor import E2M1, QuantizedTensor, dequantize

    model = build("gpt_oss", tmp_path, smollm2_path)
    _as_released_mxfp4(model, tmp_path)
    batch = prompts((5, 23, 40))
    want = [reference(model, ids, 16) for ids in batch]
    dense = engine(tmp_path, quantization="none")
    assert [o.outputs[0].token_ids for o in dense.generate(batch, GREEDY, use_tqdm=False)] == want
    first = [o.outputs[0].logprobs[0] for o in dense.generate(batch, FIRST, use_tqdm=False)]
    del dense
    llm = engine(tmp_path, quantization="gguf")
    for n, layer in enumerate(llm.engine.runner.model.layers):
        gate_up = layer.mlp.experts.gate_up_weight
        assert isinstance(gate_up, QuantizedTensor) and gate_up.bits == E2M1
        ref = model.model.layers[n].mlp.experts.gate_up_proj.detach()  # [E, H, 2I]
        held = dequantize(gate_up).reshape(ref.shape[0], ref.shape[2], ref.shape[1])
        i = ref.shape[2] // 2
        assert torch.equal(held[:, :i], ref[:, :, 0::2].transpose(1, 2))
        assert torch.equal(held[:, i:], ref[:, :, 1::2].transpose(1, 2))
    got = [o.outputs[0].logprobs[0] for o in llm.generate(batch, FIRST, use_tqdm=False)]
    for g, w in zip(got, first, strict=True):
        assert next(iter(g)) == next(iter(w))  # the greedy pick
        for token, lp in w.items():
            if token in g:
                assert abs(g[token].logprob - lp.logprob) < 0.25, token


@pytest.mark.parametrize("blocks_a_row", [1, 2, 6])
def test_mxfp4_weights_hold_transformers_values(blocks_a_row: int) -> None:
    """One MXFP4 pair as a weight: E2M1 codes where the row is a whole number of the
    layout's 64-value pairs (2 and 6 blocks), float32 where not (1 block); either way
    exactly the values transformers dequantizes the pair to."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from sluice.core.quantized_tensor import E2M1, QuantizedTensor, dequantize
    from sluice.loader import hf_mxfp4

    gen = torch.Generator().manual_seed(blocks_a_row)
    blocks = torch.randint(0, 256, (3, 5, blocks_a_row, 16), generator=gen).to(torch.uint8)
    # 2**(e - 128) over float16's powers of two, 2**-24..2**15: held exactly.
    scales = torch.randint(104, 144, (3, 5, blocks_a_row), generator=gen).to(torch.uint8)
    weight = hf_mxfp4.to_weight("w", blocks, scales)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, K, 5]
    want = want.transpose(1, 2).reshape(15, 32 * blocks_a_row)
    if blocks_a_row == 1:
        assert isinstance(weight, torch.Tensor)
        assert torch.equal(weight, want)
    else:
        assert isinstance(weight, QuantizedTensor) and weight.bits == E2M1
        assert torch.equal(dequantize(weight), want)


def test_top_k_beyond_the_expert_count_is_refused(tmp_path: Path, smollm2_path: Path) -> None:
    import json

    build("mixtral", tmp_path, smollm2_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be between 1 and"):
        engine(tmp_path)


def _quantized_stack(e: int, out: int, k: int, gen: torch.Generator) -> Any:
    from sluice.core.quantized_tensor import quantize_8bit

    return quantize_8bit(torch.randn(e * out, k, generator=gen) * 0.1)


@pytest.mark.parametrize("int8_prompts", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_quantized_experts_equal_their_dense_selves(
    kernel_level: str, tokens: int, int8_prompts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts kept in their blocks (a GGUF's) against the same weights dequantized:
    a decode step (1 token: the grouped kernel, every group one row), a few tokens
    (groups under the crossover) and a prefill (40 tokens x top 4 of 8: experts over it
    take dequantized tiles + GEMM, or with int8_prompts the int8 GEMM where the level
    has it; the rest the grouped kernel), at every kernel level. The gap is the int8
    activations' (the block kernel's own bound)."""
    from sluice.core.quantized_tensor import dequantize
    from sluice.kernels import qblock
    from sluice.layers.block_quant import INT8_GEMM_LEVELS
    from sluice.layers.experts import ExpertGroups, Experts

    calls = []
    gemm = qblock.qblock_gemm
    monkeypatch.setattr(qblock, "qblock_gemm", lambda *a, **kw: calls.append(1) or gemm(*a, **kw))

    gen = torch.Generator().manual_seed(0)
    e, h, i = 8, 128, 64
    gate, up, down = (_quantized_stack(e, *s, gen) for s in ((i, h), (i, h), (h, i)))
    quantized, dense = Experts(e, h, i), Experts(e, h, i)
    quantized.load(
        gate, up, down, dtype=torch.float32, keep_quantized=True, int8_prompts=int8_prompts
    )
    assert quantized.int8_gemm == (int8_prompts and kernel_level in INT8_GEMM_LEVELS)
    dense.load(
        *(dequantize(w).reshape(e, -1, w.shape[1]) for w in (gate, up, down)),
        dtype=torch.float32,
        keep_quantized=False,
    )
    assert quantized.lib is not None and quantized.held()[0].dtype == torch.uint8
    ids = torch.stack([torch.randperm(e, generator=gen)[:4] for _ in range(tokens)])
    groups = ExpertGroups.of(ids, e)
    x = torch.randn(tokens, h, generator=gen)[groups.order // 4]
    for fn in ("gate_up", "down"):
        rows = x if fn == "gate_up" else torch.randn(len(x), i, generator=gen)
        got = getattr(quantized, fn)(rows, groups)
        want = getattr(dense, fn)(rows, groups)
        scale = want.abs().max()
        assert (got - want).abs().max() <= 0.02 * scale, fn
    assert quantized.tokens.sum() == tokens * 4
    # 40 tokens x 4 of 8 experts: ~20 rows an expert, past the GEMM's 12.
    assert bool(calls) == (quantized.int8_gemm and tokens == 40)


def test_compile_is_refused_for_experts(tmp_path: Path, smollm2_path: Path) -> None:
    build("qwen3moe", tmp_path, smollm2_path)
    with pytest.raises(ValueError, match="compile=True does not run Mixture-of-Experts"):
        engine(tmp_path, compile=True)


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_the_engine_features_compose_with_experts(
    kind: str, tmp_path: Path, smollm2_path: Path
) -> None:
    """Nothing else in the engine knows a layer has experts: int8 KV with suffix
    speculation is lossless against int8 KV alone (the second time a prompt is asked,
    the drafts are the first answer's, and verified), a pool too small for the batch
    preempts and recomputes to the same tokens, and a choice constraint holds. gpt-oss
    brings its sinks and windowed layers (a split KV pool) to the same checks."""
    build(kind, tmp_path, smollm2_path)  # head size 32, as int8 KV needs
    batch = prompts((30, 30, 30, 30))
    base = engine(tmp_path, kv_cache_dtype="int8", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in base.generate(batch, GREEDY, use_tqdm=False)]
    del base
    one_pool = engine(tmp_path, kv_cache_dtype="int8", split_kv_pool=False)
    per_block = 0.02 / one_pool.stats()["kv_total_blocks"]  # GiB
    del one_pool
    spec = engine(
        tmp_path,
        kv_cache_dtype="int8",
        speculative_method="suffix",
        speculative_draft_cost=0.0,  # verify every draft
    )
    assert spec.engine.speculator is not None
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in spec.generate(batch, GREEDY, use_tqdm=False)]
        assert got == want
    assert spec.stats()["spec_accepted_tokens"] > 0
    del spec
    # 12 blocks of 8 tokens for four 46-token sequences: they cannot all stay resident.
    # (gpt-oss's in one pool, so that kv_total_blocks sizes it; a split pool's
    # preemption is tests/test_sliding_window.py's.)
    small = engine(
        tmp_path,
        kv_cache_dtype="int8",
        kv_cache_memory=12.5 * per_block,
        enable_prefix_caching=False,
        split_kv_pool=False,
    )
    got = [o.outputs[0].token_ids for o in small.generate(batch, GREEDY, use_tqdm=False)]
    assert got == want and small.stats()["num_preemptions"] > 0
    choice = SamplingParams(
        temperature=0, max_tokens=8, structured_output={"choice": ["yes", "no"]}
    )
    assert small.generate(batch[0], choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
