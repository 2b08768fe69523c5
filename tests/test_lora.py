"""LoRA adapters end to end on the bundled SmolLM2: fp32 greedy output equal to
transformers + peft with the same adapter, token for token; several adapters and the
base in one batch; the prefix cache never sharing KV across adapters; llama.cpp's
GGUF adapter format; and adapter files that lie, refused with the adapter named.

The adapters in tests/data/lora were trained with peft (training/train_lora.py): sql
(rank 8, all seven projections), caps (rank 16, rsLoRA, q/v) and json (rank 4, the MLP).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice import LLM, LoRARequest, SamplingParams
from sluice.core.errors import ConfigError, RequestError
from sluice.loader.lora import LoRAAdapterError, load_lora_adapter

DATA = Path(__file__).parent / "data" / "lora"
NAMES = ("sql", "caps", "json")
QUESTIONS = [
    "List the names of all customers who live in Paris.",
    "What is the capital of Japan?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def adapter(name: str) -> LoRARequest:
    return LoRARequest(name, NAMES.index(name) + 1, str(DATA / f"smollm2-{name}"))


@pytest.fixture(scope="module")
def llm() -> Any:
    """fp32, dense weights (the exactness setting), two adapter slots for three adapters."""
    return LLM(dtype="float32", kv_cache_memory=0.25, enable_lora=True, max_loras=2)


@pytest.fixture(scope="module")
def chat_ids(llm: Any) -> list[list[int]]:
    tok = llm.tokenizer
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def alone(llm: Any, chat_ids: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """Each adapter's (and the base's) greedy tokens, one request at a time."""
    runs: dict[str | None, list[list[int]]] = {}
    for name in (None, *NAMES):
        lora = None if name is None else adapter(name)
        runs[name] = [
            _tokens(llm.generate([ids], GREEDY, use_tqdm=False, lora_request=lora))[0]
            for ids in chat_ids
        ]
    return runs


def _peft_greedy(hf_model: Any, folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    import peft

    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), str(folder)).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=GREEDY.max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("name", NAMES)
def test_adapter_output_equals_peft(
    name: str,
    alone: dict[str | None, list[list[int]]],
    chat_ids: list[list[int]],
    hf_smollm2: tuple[Any, Any],
) -> None:
    ref = _peft_greedy(hf_smollm2[0], DATA / f"smollm2-{name}", chat_ids)
    got = alone[name]
    # The EOS a short answer ends with: the reference runs on past it, sluice stops.
    assert [r[: len(g)] for r, g in zip(ref, got, strict=True)] == got
    assert all(len(g) >= 8 for g in got)
    assert got != alone[None], f"the {name} adapter changed nothing"


def test_adapters_have_their_trained_effect(
    llm: Any, alone: dict[str | None, list[list[int]]]
) -> None:
    text = {k: [llm.tokenizer.decode(t) for t in v] for k, v in alone.items()}
    assert "SELECT" in text["sql"][0]
    caps = text["caps"][1]
    assert sum(c.isupper() for c in caps) > 3 * sum(c.islower() for c in caps), caps
    assert text["json"][1].lstrip().startswith("{"), text["json"][1]


def test_mixed_batch_equals_each_alone(
    llm: Any, chat_ids: list[list[int]], alone: dict[str | None, list[list[int]]]
) -> None:
    """Three adapters and the base in one generate call, two slots: every request gets
    the tokens it gets alone (the third adapter waits for a slot)."""
    names: list[str | None] = [None, *NAMES, "sql", None]
    prompts = [chat_ids[i % 2] for i in range(len(names))]
    loras = [None if n is None else adapter(n) for n in names]
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert got == [alone[n][i % 2] for i, n in enumerate(names)]
    runner = llm.engine.runner
    assert runner.lora.num_loaded == 2
    assert llm.engine.kv.usage == 0  # every block back: none leaked


def test_prefix_cache_never_shares_kv_across_adapters(llm: Any) -> None:
    prompt = "The history of the printing press begins " * 12  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=8)
    llm.generate([prompt], params, use_tqdm=False)  # the base's blocks, now cached
    (first,) = llm.generate([prompt], params, use_tqdm=False, lora_request=adapter("caps"))
    (again,) = llm.generate([prompt], params, use_tqdm=False, lora_request=adapter("caps"))
    assert first.num_cached_tokens == 0  # the base's blocks do not answer for the adapter
    assert again.num_cached_tokens >= 16  # its own blocks do
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_unloaded_adapter_lets_running_requests_finish(
    llm: Any, chat_ids: list[list[int]], alone: dict[str | None, list[list[int]]]
) -> None:
    engine = llm.engine
    temp = LoRARequest("temp-sql", 9, str(DATA / "smollm2-sql"))
    engine.add_request("unload-0", chat_ids[0], GREEDY, lora_request=temp)
    engine.step()
    assert engine.lora.unregister("temp-sql")
    outs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(outs["unload-0"].outputs[0].token_ids) == alone["sql"][0]
    assert "temp-sql" not in engine.lora.names()


@pytest.fixture(scope="module")
def embed_head_adapter(tmp_path_factory: Any, hf_smollm2: tuple[Any, Any]) -> Path:
    """A PEFT adapter on the token embedding, the head and q/v (rank 8, seeded random
    weights, small enough to keep the model fluent, large enough to change its answers)."""
    import peft

    config = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"],
        init_lora_weights=False,
    )
    model = peft.get_peft_model(copy.deepcopy(hf_smollm2[0]), config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_embedding_A" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.03)
    folder = tmp_path_factory.mktemp("lora") / "embed-head"
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def embed_head(
    llm: Any, embed_head_adapter: Path, chat_ids: list[list[int]]
) -> tuple[LoRARequest, list[list[int]]]:
    """The embedding-and-head adapter's request and its fp32 greedy tokens alone."""
    lora = LoRARequest("embed-head", 40, str(embed_head_adapter))
    return lora, _tokens(llm.generate(chat_ids, GREEDY, use_tqdm=False, lora_request=lora))


@pytest.mark.parametrize("lora_dtype", ["auto", "model"])
def test_quantized_base_agrees_with_reference(
    chat_ids: list[list[int]],
    alone: dict[str | None, list[list[int]]],
    embed_head: tuple[LoRARequest, list[list[int]]],
    lora_dtype: str,
) -> None:
    """On the GGUF's own Q4_1 weights (kept quantized, in the default dtype) the
    adapters still steer, in int8 slots (auto, beside quantized weights) as in bf16
    ones: the SQL adapter writes SQL, the answers follow the fp32 dense run for most
    of their tokens, and fed the fp32 run's answers, the next token it predicts is the
    fp32 run's almost everywhere, also with the embedding-and-head adapter (its head
    in int8 slots too). Measured on the project's Zen 4 (bf16): the trained adapters'
    first divergence after 74 (int8) and 92 (bf16) of 105 tokens, pinned at 60%;
    next-token agreement on all four adapters' answers 139 (int8) and 140 (bf16) of
    141 (on 8 prompts of 32 tokens, the trained adapters, ad hoc: 99.6% int8, 99.4%
    bf16), pinned at 95%."""
    llm = LLM(kv_cache_memory=0.25, enable_lora=True, max_loras=3, lora_dtype=lora_dtype)
    assert llm.engine.runner.lora.layers[0].int8 == (lora_dtype == "auto")
    runs = {name: (adapter(name), alone[name]) for name in NAMES} | {"embed-head": embed_head}
    agreed = total = predicted = forced_total = 0
    for name, (lora, refs) in runs.items():
        outs = llm.generate(chat_ids, GREEDY, use_tqdm=False, lora_request=lora)
        for got, ref in zip(_tokens(outs), refs, strict=True):
            pairs = zip(got, ref, strict=False)
            if name in NAMES:  # the random adapter's answers are not a model's
                same = min(len(got), len(ref))
                agreed += next((i for i, (a, b) in enumerate(pairs) if a != b), same)
                total += len(ref)
            forced_total += len(ref)
        if name == "sql":
            assert "SELECT" in llm.tokenizer.decode(_tokens(outs)[0])
        forced = [ids + ref for ids, ref in zip(chat_ids, refs, strict=True)]
        scored = llm.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=1),
                              use_tqdm=False, lora_request=lora)  # fmt: skip
        for out, ids, ref in zip(scored, chat_ids, refs, strict=True):
            for k, token in enumerate(ref):
                ranked = out.prompt_logprobs[len(ids) + k]
                predicted += max(ranked, key=lambda t: ranked[t].logprob) == token
    assert agreed >= 0.6 * total, (agreed, total)
    assert predicted >= 0.95 * forced_total, (predicted, forced_total)


def _write_gguf_adapter(
    folder: Path, out: Path, n_head: int, n_kv: int, arch: str = "llama"
) -> None:
    """A PEFT adapter in llama.cpp's GGUF adapter layout, as convert_lora_to_gguf.py
    writes it: blk.N.<name>.weight.lora_a/_b, q/k rows permuted for a llama's rope
    (Phi-3's fused qkv_proj and gate_up_proj as attn_qkv and ffn_up, not permuted)."""
    import gguf

    cfg = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}  # fmt: skip

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return (
            w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for name, t in sorted(tensors.items()):
        if ".base_layer." in name:  # peft's copy of the base embedding or head
            continue
        which = "a" if "lora_A" in name or "lora_embedding_A" in name else "b"
        w = t.float().numpy()
        if ".embed_tokens." in name:  # A stored transposed: a token's row (llama.cpp)
            writer.add_tensor(f"token_embd.weight.lora_{which}", w.T if which == "a" else w)
            continue
        if ".lm_head." in name:
            writer.add_tensor(f"output.weight.lora_{which}", w)
            continue
        parts = name.split(".")
        layer, target = int(parts[4]), parts[6]
        if which == "b" and target in ("q_proj", "k_proj") and arch == "llama":
            w = permute(w, n_head if target == "q_proj" else n_kv)
        writer.add_tensor(f"blk.{layer}.{names[target]}.weight.lora_{which}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_adapter_equals_peft_folder(
    llm: Any, chat_ids: list[list[int]], alone: dict[str | None, list[list[int]]], tmp_path: Path
) -> None:
    mc = llm.engine.model_config
    path = tmp_path / "sql.gguf"
    _write_gguf_adapter(DATA / "smollm2-sql", path, mc.num_heads, mc.num_kv_heads)
    lora = LoRARequest("sql-gguf", 20, str(path))
    got = _tokens(llm.generate(chat_ids, GREEDY, use_tqdm=False, lora_request=lora))
    assert got == alone["sql"]


def test_embedding_and_head_adapter_equals_peft(
    llm: Any,
    embed_head_adapter: Path,
    embed_head: tuple[LoRARequest, list[list[int]]],
    chat_ids: list[list[int]],
    alone: dict[str | None, list[list[int]]],
    hf_smollm2: tuple[Any, Any],
    tmp_path: Path,
) -> None:
    """An adapter of the embedding and the head: fp32 greedy equal to peft's, alone and
    beside the base and another adapter in one batch, and from llama.cpp's GGUF form."""
    names = set(load_file(str(embed_head_adapter / "adapter_model.safetensors")))
    assert any("lora_embedding_A" in n for n in names) and any("lm_head" in n for n in names)
    ref = _peft_greedy(hf_smollm2[0], embed_head_adapter, chat_ids)
    lora, got = embed_head
    assert [r[: len(g)] for r, g in zip(ref, got, strict=True)] == got
    assert all(len(g) >= 8 for g in got) and got != alone[None]
    mixed = llm.generate(
        [chat_ids[0], chat_ids[0], chat_ids[1]],
        GREEDY,
        use_tqdm=False,
        lora_request=[lora, None, adapter("sql")],
    )
    assert _tokens(mixed) == [got[0], alone[None][0], alone["sql"][1]]
    mc = llm.engine.model_config
    path = tmp_path / "embed-head.gguf"
    _write_gguf_adapter(embed_head_adapter, path, mc.num_heads, mc.num_kv_heads)
    from_gguf = LoRARequest("embed-head-gguf", 41, str(path))
    assert _tokens(llm.generate(chat_ids, GREEDY, use_tqdm=False, lora_request=from_gguf)) == got


def test_lora_request_needs_enable_lora(llm_fp32: Any) -> None:
    with pytest.raises(RequestError, match="enable_lora"):
        llm_fp32.generate(["x"], GREEDY, use_tqdm=False, lora_request=adapter("sql"))


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"lora_modules": ("a=/x",)}, "lora_modules"),
        ({"enable_lora": True, "lora_modules": ("nopath",)}, "lora_modules"),
        ({"enable_lora": True, "lora_modules": ("a=/x", "a=/y")}, "lora_modules"),
        ({"enable_lora": True, "max_loras": 0}, "max_loras"),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"enable_lora": True, "compile": True}, "enable_lora"),
        ({"enable_lora": True, "lora_dtype": "fp4"}, "lora_dtype"),
    ],
)
def test_bad_options_name_their_field(options: dict[str, Any], field: str) -> None:
    from sluice.config import EngineConfig

    with pytest.raises(ConfigError) as info:
        EngineConfig(**options)
    assert info.value.param == field


def test_lora_dtype_auto_is_int8_beside_quantized_weights() -> None:
    from sluice.config import resolve_lora_dtype

    assert resolve_lora_dtype("auto", "gguf") and resolve_lora_dtype("auto", "int4")
    assert not resolve_lora_dtype("auto", "none")
    assert resolve_lora_dtype("int8", "none") and not resolve_lora_dtype("model", "gguf")


# ---- adapter files that lie ---------------------------------------------------------


def _copy(tmp_path: Path, name: str = "sql") -> Path:
    dst = tmp_path / f"bad-{name}"
    shutil.copytree(DATA / f"smollm2-{name}", dst)
    return dst


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, edit: Any) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


Q_A = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"


def _wrong_rank(f: Path) -> None:
    _edit_config(f, r=4)


def _rank_above_limit(f: Path) -> None:
    _edit_config(f, r=64)


def _wrong_shape(f: Path) -> None:
    _edit_tensors(f, lambda t: t.__setitem__(Q_B, torch.zeros(100, 8)))


def _unknown_target(f: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["base_model.model.model.norm.lora_A.weight"] = torch.zeros(8, 576)

    _edit_tensors(f, add)


def _missing_partner(f: Path) -> None:
    _edit_tensors(f, lambda t: t.pop(Q_B))


def _layer_out_of_range(f: Path) -> None:
    def move(t: dict[str, torch.Tensor]) -> None:
        t[Q_A.replace("layers.3.", "layers.99.")] = t.pop(Q_A)
        t[Q_B.replace("layers.3.", "layers.99.")] = t.pop(Q_B)

    _edit_tensors(f, move)


def _nan(f: Path) -> None:
    _edit_tensors(f, lambda t: t[Q_A].__setitem__((0, 0), float("nan")))


def _int_dtype(f: Path) -> None:
    _edit_tensors(f, lambda t: t.__setitem__(Q_A, t[Q_A].to(torch.int32)))


def _truncated(f: Path) -> None:
    path = f / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage_config(f: Path) -> None:
    (f / "adapter_config.json").write_text("{not json")


def _dora(f: Path) -> None:
    _edit_config(f, use_dora=True)


def _unsupported_target_listed(f: Path) -> None:
    _edit_config(f, target_modules=["q_proj", "score"])


def _resized_vocabulary(f: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:  # trained with 3 added tokens
        t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 49155)
        t["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.zeros(576, 8)

    _edit_tensors(f, add)


def _head_inside_a_layer(f: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t[Q_A.replace("q_proj", "lm_head")] = t.pop(Q_A)
        t[Q_B.replace("q_proj", "lm_head")] = t.pop(Q_B)

    _edit_tensors(f, add)


def _pickled_only(f: Path) -> None:
    (f / "adapter_config.json").unlink()
    (f / "adapter_model.bin").write_bytes(b"\x80\x04")


def _oversized(f: Path) -> None:
    with (f / "adapter_model.safetensors").open("ab") as fh:
        fh.truncate(300 << 20)  # past rank 16's low-rank bytes and peft's base copies


BAD = {
    "wrong rank": (_wrong_rank, "has rank 8, the config says r=4"),
    "rank above limit": (_rank_above_limit, "above max_lora_rank"),
    "wrong shape": (_wrong_shape, "expected [576, 8]"),
    "unknown target": (_unknown_target, "norm.lora_A.weight is not a LoRA weight"),
    "resized vocabulary": (_resized_vocabulary, "expected [rank <= 16, 49152] for embed_tokens"),
    "head inside a layer": (_head_inside_a_layer, "lm_head.lora_A.weight is not a LoRA weight"),
    "missing B": (_missing_partner, "has no partner"),
    "layer out of range": (_layer_out_of_range, "layer 99"),
    "NaN": (_nan, "inf or NaN"),
    "integer tensor": (_int_dtype, "dtype torch.int32"),
    "truncated": (_truncated, "not a valid safetensors file"),
    "garbage config": (_garbage_config, "not valid JSON"),
    "DoRA": (_dora, "DoRA"),
    "unlisted target": (_unsupported_target_listed, "target module 'score'"),
    "pickled only": (_pickled_only, "pickled"),
    "oversized": (_oversized, "more than an adapter of rank <= 16"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_refused_by_name(case: str, tmp_path: Path, llm: Any) -> None:
    corrupt, defect = BAD[case]
    folder = _copy(tmp_path)
    corrupt(folder)
    with pytest.raises(LoRAAdapterError) as info:
        load_lora_adapter("broken", str(folder), llm.engine.model_config, 16)
    message = str(info.value)
    assert "'broken'" in message and str(folder) in message
    assert defect in message, message


def test_bad_adapter_request_leaves_the_engine_serving(
    llm: Any, tmp_path: Path, chat_ids: list[list[int]], alone: dict[str | None, list[list[int]]]
) -> None:
    folder = _copy(tmp_path)
    _truncated(folder)
    with pytest.raises(LoRAAdapterError):
        llm.generate(
            ["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 30, str(folder))
        )
    assert not llm.engine.has_unfinished_requests()
    got = _tokens(llm.generate([chat_ids[0]], GREEDY, use_tqdm=False, lora_request=adapter("sql")))
    assert got == [alone["sql"][0]]


def test_speculation_and_constraints_run_through_the_adapter(
    chat_ids: list[list[int]], alone: dict[str | None, list[list[int]]]
) -> None:
    """n-gram speculation verifies with the request's adapter (greedy output unchanged,
    drafts accepted), and a constrained request's grammar applies on top of it."""
    llm = LLM(
        dtype="float32",
        kv_cache_memory=0.25,
        enable_lora=True,
        speculative_method="ngram",
        num_speculative_tokens=3,
        speculative_draft_cost=0.05,  # the seam, not the measured cost model
    )
    prompts = chat_ids * 2
    loras = [adapter("sql"), adapter("caps")] * 2
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert got == [alone["sql"][0], alone["caps"][1]] * 2
    stats = llm.stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"]}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=48, structured_output={"json": schema})
    (out,) = llm.generate([chat_ids[1]], params, use_tqdm=False, lora_request=adapter("json"))
    assert "answer" in json.loads(out.outputs[0].text)


def test_phi3_fused_module_adapter_equals_peft(tmp_path: Path, smollm2_path: Path) -> None:
    """Phi-3's adapters train on its fused modules (qkv_proj, gate_up_proj): each is cut
    into one per projection (the same A, its rows of B), and greedy output equals peft's
    on a random-weight Phi-3 in fp32, from the PEFT folder and from llama.cpp's GGUF
    form (attn_qkv, ffn_up)."""
    import peft

    from benchmarks.random_models import SMALL, build_model
    from sluice.loader import tokenizer_from_gguf

    model = build_model("phi3", SMALL, tmp_path / "base")
    tokenizer_from_gguf(smollm2_path).save(tmp_path / "base")
    config = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        init_lora_weights=False,
    )
    tuned = peft.get_peft_model(copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    tuned.save_pretrained(str(tmp_path / "adapter"))
    names = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert any(".qkv_proj.lora_B" in n for n in names)
    prompts = [list(range(5, 17)), list(range(300, 340, 3))]
    ref = _peft_greedy(model, tmp_path / "adapter", prompts)
    llm = LLM(model=str(tmp_path / "base"), dtype="float32", kv_cache_memory=0.02, enable_lora=True)
    lora = LoRARequest("phi3", 1, str(tmp_path / "adapter"))
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora))
    assert [r[: len(g)] for r, g in zip(ref, got, strict=True)] == got
    assert all(len(g) >= 8 for g in got)
    assert got != _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    mc = llm.engine.model_config
    path = tmp_path / "phi3.gguf"
    _write_gguf_adapter(tmp_path / "adapter", path, mc.num_heads, mc.num_kv_heads, "phi3")
    from_gguf = LoRARequest("phi3-gguf", 2, str(path))
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=from_gguf)) == got
    # q adapted twice, inside attn_qkv and apart: refused by name, not summed or dropped.
    import gguf

    reader = gguf.GGUFReader(str(path))
    twice = gguf.GGUFWriter(str(tmp_path / "twice.gguf"), "phi3")
    twice.add_type("adapter")
    twice.add_string("adapter.type", "lora")
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    q_rows = mc.num_heads * mc.head_dim
    tensors["blk.0.attn_q.weight.lora_a"] = tensors["blk.0.attn_qkv.weight.lora_a"]
    tensors["blk.0.attn_q.weight.lora_b"] = tensors["blk.0.attn_qkv.weight.lora_b"][:q_rows]
    for name, t in tensors.items():
        twice.add_tensor(name, t)
    twice.write_header_to_file()
    twice.write_kv_data_to_file()
    twice.write_tensors_to_file()
    twice.close()
    bad = LoRARequest("twice", 3, str(tmp_path / "twice.gguf"))
    with pytest.raises(ValueError, match=r"'twice'.*blk\.0\.attn_q\.weight twice"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=bad)
