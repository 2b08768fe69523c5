"""Mixture-of-Experts models from GGUF files laid out as llama.cpp's converter writes
them (benchmarks/random_gguf.py): in F32, greedy output equals transformers' on the
same weights token for token; in Q8_0, the experts stay in their blocks (never a dense
copy: the weight bytes are the file's) and agree with the F32 file; files whose expert
tensors disagree with their metadata are refused before any weight is read. Llama 3's
rope scaling, which the converter writes as the rope_freqs.weight tensor, rides along:
the same F32 check, and a file whose factors are malformed is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from benchmarks.random_gguf import hf_to_gguf
from benchmarks.random_models import MOE_KINDS, SMALL, build_model
from sluice import LLM, SamplingParams
from sluice.core.quantized_tensor import QuantizedTensor, dequantize
from sluice.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
# A 512-token vocabulary: reading SmolLM2's 49,152 tokens out of a GGUF takes seconds
# each time a file is written, read back or loaded.
VOCAB = 512
SHAPE = {**SMALL, "vocab_size": VOCAB}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer-only GGUF of VOCAB byte-level tokens."""
    path = tmp_path_factory.mktemp("tok") / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<|endoftext|>"] + [f"t{i}" for i in range(1, VOCAB)])
    w.add_token_types([3] + [1] * (VOCAB - 1))
    w.add_token_merges([])
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (7, 33)]


def _reference(model: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )
    return list(out[0, len(ids) :].tolist())


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(
        model=str(path),
        kv_cache_memory=0.02,
        block_size=8,
        max_num_batched_tokens=16,
        **kwargs,
    )


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_f32_gguf_equals_transformers(kind: str, tmp_path: Path, tokenizer: Path) -> None:
    model = build_model(kind, SHAPE, tmp_path / "hf")
    path = tmp_path / f"{kind}.gguf"
    hf_to_gguf(tmp_path / "hf", path, tokenizer_gguf=tokenizer)
    llm = _llm(path, dtype="float32", quantization="none")
    assert llm.engine.model_config.num_experts == 8
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_reference(model, p) for p in _prompts()]


@pytest.mark.parametrize("kind", ["mistral-nemo", "granite", "phi3"])
def test_dense_family_gguf_equals_transformers(kind: str, tmp_path: Path, tokenizer: Path) -> None:
    """Mistral-Nemo's head size is not hidden / heads (128 of 5120 / 32): the GGUF says
    so in attention.key_length, and the q/k permutation and attention follow it.
    Granite's four scalings come as granite.*_scale keys. Phi-3's q/k/v and gate/up
    come fused (attn_qkv, ffn_up) and are cut apart."""
    model = build_model(kind, SHAPE, tmp_path / "hf")
    path = tmp_path / f"{kind}.gguf"
    hf_to_gguf(tmp_path / "hf", path, tokenizer_gguf=tokenizer)
    llm = _llm(path, dtype="float32", quantization="none")
    config = llm.engine.model_config
    if kind == "mistral-nemo":
        assert config.head_dim * config.num_heads != config.hidden_size
    elif kind == "granite":
        scalings = (config.residual_multiplier, config.logits_scaling)
        assert scalings == (pytest.approx(0.22), 4.0)  # float32 in the file
    # ignore_eos, not min_tokens: this model's greedy 12th token is the tokenizer's EOS
    # (id 0; transformers' config says 2), which min_tokens would mask.
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(_prompts(), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_reference(model, p) for p in _prompts()]


@pytest.mark.parametrize("kind", ["phi3-longrope", "phi4-mini"])
def test_phi3_longrope_gguf_equals_transformers(kind: str, tmp_path: Path, tokenizer: Path) -> None:
    """LongRoPE from a GGUF (rope_factors_short/long tensors, the trained context and
    the attention factor as keys): short factors serving the trained context (64),
    long ones past it, as tests/test_architectures.py checks from config.json;
    Phi-4-mini's rotary dims from rope.dimension_count (24 of 32)."""
    model = build_model(kind, SHAPE, tmp_path / "hf")
    path = tmp_path / "phi3.gguf"
    hf_to_gguf(tmp_path / "hf", path, tokenizer_gguf=tokenizer)
    for max_model_len, prompts in ((64, _prompts()), (512, [list(range(3, 90))])):
        llm = _llm(path, dtype="float32", quantization="none", max_model_len=max_model_len)
        config = llm.engine.model_config
        assert config.rope_scaling["rope_type"] == "longrope"
        assert config.rotary_dim == (24 if kind == "phi4-mini" else None)
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [_reference(model, p) for p in prompts]


def test_llama3_rope_freqs_gguf_equals_transformers(tmp_path: Path, tokenizer: Path) -> None:
    # Positions past original_max_position_embeddings (64) and inside it: the 33-token
    # prompt and 12 new tokens cross where llama3's scaled and unscaled bands differ.
    model = build_model("llama-rope3", SHAPE, tmp_path / "hf")
    path = tmp_path / "llama3.gguf"
    hf_to_gguf(tmp_path / "hf", path, tokenizer_gguf=tokenizer)
    llm = _llm(path, dtype="float32", quantization="none")
    assert llm.engine.model_config.rope_scaling["rope_type"] == "freq_factors"
    prompts = [*_prompts(), list(range(3, 90))]  # 87 tokens: beyond the original context
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_reference(model, p) for p in prompts]


@pytest.mark.parametrize(
    ("factors", "message"),
    [
        (np.ones(3, dtype=np.float32), "F32 of 16 values"),
        (np.array([1] * 15 + [-2], dtype=np.float32), "finite positive"),
        (np.array([1] * 15 + [np.nan], dtype=np.float32), "finite positive"),
        (np.ones(16, dtype=np.float16), "F32 of 16 values"),
    ],
)
def test_malformed_rope_freqs_are_refused(
    factors: np.ndarray, message: str, tmp_path: Path, tokenizer: Path
) -> None:
    build_model("llama-rope3", SHAPE, tmp_path / "hf")
    good = tmp_path / "good.gguf"
    hf_to_gguf(tmp_path / "hf", good, tokenizer_gguf=tokenizer)
    bad = tmp_path / "bad.gguf"

    def change(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        tensors["rope_freqs.weight"] = factors

    _rewrite(good, bad, change)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(bad), dtype="float32", quantization="none")


# In memory, a block of the file's type takes this many times its bytes: Q8_0 keeps its
# fp16 scale beside its 32 bytes, as the file does; MXFP4 (4.25 bits a weight) keeps
# its 4-bit codes with an fp16 scale where the file has an 8-bit exponent (4.5 bits).
HELD_PER_FILE_BYTE = {"Q8_0": 1.0, "MXFP4": 4.5 / 4.25}


@pytest.mark.parametrize(
    ("kind", "tensor_type"),
    [("qwen3moe", "Q8_0"), ("granitemoe", "Q8_0"), ("gpt_oss", "MXFP4")],
)
def test_quantized_experts_stay_quantized_and_agree_with_their_dense_selves(
    kind: str, tensor_type: str, tmp_path: Path, tokenizer: Path
) -> None:
    """A Q8_0 file (gpt-oss's: MXFP4 experts) on the block kernels: the expert stacks
    are held as the file's blocks (weight_bytes within a few percent of the file's
    bytes in their layout: no dense copy), and each prompt's next-token distribution
    is the one the same weights give dequantized, to the int8 activations' rounding
    (same top token, logprobs within 0.25 nats after 3 layers of random weights; a
    wrong expert's rows would change them outright). Granite-MoE's file has gate and
    up in one stack, cut per expert in its blocks."""
    model = build_model(kind, SHAPE, tmp_path / "hf")
    q8 = tmp_path / "q8.gguf"
    hf_to_gguf(tmp_path / "hf", q8, tensor_type=tensor_type, tokenizer_gguf=tokenizer)
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    llm = _llm(q8, dtype="float32", quantization="gguf")
    assert llm.engine.quantization == "gguf"
    gate_up = llm.engine.runner.model.layers[0].mlp.experts.gate_up_weight
    assert isinstance(gate_up, QuantizedTensor)
    assert gate_up.source == tensor_type
    tensors = gguf.GGUFReader(q8).tensors
    held = sum(int(t.n_bytes) * HELD_PER_FILE_BYTE.get(t.tensor_type.name, 1.0) for t in tensors)
    assert abs(llm.stats()["weight_bytes"] - held) <= 0.03 * held
    got = [o.outputs[0].logprobs[0] for o in llm.generate(_prompts(), sp, use_tqdm=False)]
    del llm
    dense = _llm(q8, dtype="float32", quantization="none")
    want = [o.outputs[0].logprobs[0] for o in dense.generate(_prompts(), sp, use_tqdm=False)]
    for g, w in zip(got, want, strict=True):
        assert next(iter(g)) == next(iter(w))  # the greedy pick
        for token, lp in w.items():
            if token in g:
                assert abs(g[token].logprob - lp.logprob) < 0.25, token
    if kind == "granitemoe":
        # Rows cut wrongly from the blocks would agree with themselves above: the held
        # stack (each expert's gate rows, then its up rows) is the checkpoint's
        # [E, 2I, H] to Q8_0's rounding.
        ref = model.model.layers[0].block_sparse_moe.experts.gate_up_proj.detach()
        held = dequantize(gate_up).reshape(ref.shape)
        assert torch.allclose(held, ref, rtol=0, atol=0.01 * ref.abs().max().item())


def _rewrite(src: Path, dst: Path, change: Any) -> None:
    """A copy of the GGUF at src with `change(name, array, metadata)` applied to its
    tensors (returning None drops one) and its metadata dict (new keys: uint32)."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    meta = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.") and name != "general.architecture"
    }
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    change(tensors, meta)
    for key, value in meta.items():
        if key not in reader.fields:  # a key the change adds (an integer, so far)
            writer.add_uint32(key, value)
            continue
        field = reader.fields[key]
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def olmoe_gguf(tmp_path_factory: pytest.TempPathFactory, tokenizer: Path) -> Path:
    directory = tmp_path_factory.mktemp("olmoe")
    build_model("olmoe", SHAPE, directory / "hf")
    hf_to_gguf(directory / "hf", directory / "olmoe.gguf", tokenizer_gguf=tokenizer)
    return directory / "olmoe.gguf"


@pytest.mark.parametrize(
    ("defect", "message"),
    [
        ("no_router", r"missing tensor 'blk\.1\.ffn_gate_inp\.weight'"),
        ("expert_count", r"'blk\.0\.ffn_gate_inp\.weight' has shape \[8, 128\]; .*12 experts"),
        ("top_k", r"num_experts_per_tok \(9\) must be between 1 and num_experts \(8\)"),
        ("expert_size", r"'blk\.0\.ffn_gate_exps\.weight' has shape \[8, 64, 128\].*needs"),
    ],
)
def test_a_file_that_lies_about_its_experts_is_refused(
    defect: str, message: str, tmp_path: Path, olmoe_gguf: Path
) -> None:
    bad = tmp_path / "bad.gguf"

    def change(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        if defect == "no_router":
            del tensors["blk.1.ffn_gate_inp.weight"]
        elif defect == "expert_count":
            meta["olmoe.expert_count"] = 12
        elif defect == "top_k":
            meta["olmoe.expert_used_count"] = 9
        else:
            meta["olmoe.feed_forward_length"] = 48  # OLMoE's expert size

    _rewrite(olmoe_gguf, bad, change)
    with pytest.raises(ValueError, match=message):
        load_model(str(bad))


def test_granite_moe_files_that_do_not_fit_are_refused(tmp_path: Path, tokenizer: Path) -> None:
    """A Granite-MoE file whose metadata promises a shared expert it does not hold, or
    whose shared expert is not the promised size, is refused by the tensor's name, and
    a fused gate/up stack of the wrong size by name, before any weight is read."""
    build_model("granitemoe", SHAPE, tmp_path / "hf")
    good = tmp_path / "good.gguf"
    hf_to_gguf(tmp_path / "hf", good, tokenizer_gguf=tokenizer)

    def promised(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        meta["granitemoe.expert_shared_feed_forward_length"] = 32

    _rewrite(good, tmp_path / "promised.gguf", promised)
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.0\.ffn_gate_shexp\.weight'"):
        load_model(str(tmp_path / "promised.gguf"))

    build_model("granitemoeshared", SHAPE, tmp_path / "hf-shared")
    shared = tmp_path / "shared.gguf"
    hf_to_gguf(tmp_path / "hf-shared", shared, tokenizer_gguf=tokenizer)

    def narrow(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        tensors["blk.1.ffn_up_shexp.weight"] = np.ascontiguousarray(
            tensors["blk.1.ffn_up_shexp.weight"][:-8]
        )

    _rewrite(shared, tmp_path / "narrow.gguf", narrow)
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up_shexp\.weight' has shape"):
        load_model(str(tmp_path / "narrow.gguf"))

    def short(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        stack = tensors["blk.1.ffn_gate_up_exps.weight"]
        tensors["blk.1.ffn_gate_up_exps.weight"] = np.ascontiguousarray(stack[:, :-2])

    _rewrite(good, tmp_path / "short.gguf", short)
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_gate_up_exps\.weight' has shape"):
        load_model(str(tmp_path / "short.gguf"))
