"""Embedding models: vectors equal to sentence-transformers', batched by the engine's
scheduler, served on /v1/embeddings (the official OpenAI client), /v1/score and /v1/rerank,
and refused input named.

The default run uses the packaged all-MiniLM-L6-v2 (BERT); `make test-slow` adds
all-mpnet-base-v2 (MPNet's relative positions) and EmbeddingGemma-300M (Gemma 3 both
ways, inputs past its 512-token window, Matryoshka sizes).
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from serving import Server, serve, wait_idle

from sluice import LLM, PoolingParams, SamplingParams
from sluice.core.errors import ModelFileError, RequestError
from sluice.loader.hf_loader import config_from_hf, read_json
from sluice.loader.resolve import KNOWN_MODELS, installed_parts, resolve_model_path
from sluice.loader.sentence_transformers import read_pooler

MINILM = "all-minilm-l6-v2"
SHORT = ["A man is eating food.", "hi", "The quick brown fox jumps over the lazy dog."]
# Past all-MiniLM-L6-v2's 256-token limit; sentence-transformers cuts it there.
LONG = "Rivers carry the rain from the hills down to the sea, " * 40


def _cosines(got: list[list[float]], ref: np.ndarray) -> list[float]:
    g, r = torch.tensor(got), torch.tensor(ref)
    return torch.nn.functional.cosine_similarity(g, r).tolist()


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return resolve_model_path(MINILM)


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(MINILM, dtype="float32")


def test_vectors_equal_sentence_transformers_in_fp32(
    llm: LLM, reference: SentenceTransformer
) -> None:
    texts = [*SHORT, LONG]
    ref = reference.encode(texts)
    outs = llm.embed(texts, PoolingParams(truncate_prompt_tokens=256), use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outs][-1] == 256
    assert min(_cosines([o.outputs.embedding for o in outs], ref)) >= 0.99999
    # Normalized as the model's pipeline ends in Normalize.
    assert all(abs(np.linalg.norm(o.outputs.embedding) - 1) < 1e-5 for o in outs)


def test_an_input_is_the_same_alone_and_in_a_mixed_batch(llm: LLM) -> None:
    alone = [llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in SHORT]
    together = [o.outputs.embedding for o in llm.embed(SHORT * 3, use_tqdm=False)]
    for i, vec in enumerate(together):
        assert np.allclose(vec, alone[i % len(SHORT)], atol=1e-5)


def test_bf16_vectors_stay_close(reference: SentenceTransformer) -> None:
    llm = LLM(MINILM, dtype="bfloat16")
    ref = reference.encode(SHORT)
    got = [o.outputs.embedding for o in llm.embed(SHORT, use_tqdm=False)]
    assert min(_cosines(got, ref)) >= 0.999


def test_the_scheduler_grants_inputs_whole_and_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    # 40 inputs of 250 tokens: 8 fill 2000 of a step's 2048; a chunk of the 9th would fit.
    texts = [f"{i} {LONG}" for i in range(40)]
    for i, text in enumerate(texts):
        engine.add_request(f"e{i}", text, PoolingParams(truncate_prompt_tokens=250))
    steps, done = 0, set()
    while engine.has_unfinished_requests():
        scheduled_before = engine.scheduler.waiting.copy()
        for out in engine.step():
            assert out.finished and out.embedding is not None
            done.add(out.request_id)
        steps += 1
        assert not engine.scheduler.running  # nothing left half-computed
        assert len(scheduled_before) >= len(engine.scheduler.waiting)
    assert len(done) == 40 and steps > 1
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_bad_embedding_requests_name_their_field(llm: LLM) -> None:
    engine = llm.engine
    cases = [
        ("", PoolingParams(), "prompt"),
        (LONG, PoolingParams(), "input"),
        ("hi", PoolingParams(dimensions=100), "dimensions"),
    ]
    for prompt, params, field in cases:
        with pytest.raises(RequestError) as err:
            engine.add_request("bad", prompt, params)
        assert err.value.param == field
    with pytest.raises(RequestError) as err:
        engine.add_request("gen", "hi", SamplingParams(max_tokens=4))
    assert err.value.param == "model" and "embedding model" in str(err.value)
    with pytest.raises(RequestError) as err:
        PoolingParams(truncate_prompt_tokens=0)
    assert err.value.param == "truncate_prompt_tokens"
    assert not engine.has_unfinished_requests()
    assert llm.embed("still serving", use_tqdm=False)[0].outputs.embedding


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serve("--model", MINILM, "--dtype", "float32") as srv:
        yield srv


def test_openai_client_embeddings_float_and_base64(
    server: Server, reference: SentenceTransformer
) -> None:
    client = server.client()
    ref = reference.encode(SHORT)
    as_float = client.embeddings.create(model=MINILM, input=SHORT, encoding_format="float")
    assert [d.index for d in as_float.data] == [0, 1, 2]
    assert min(_cosines([d.embedding for d in as_float.data], ref)) >= 0.99999
    assert as_float.usage.prompt_tokens == sum(
        len(reference.tokenize([t])["input_ids"][0]) for t in SHORT
    )
    one = client.embeddings.create(model=MINILM, input=SHORT[0], encoding_format="float")
    raw = client.embeddings.create(model=MINILM, input=SHORT[0], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert np.array_equal(decoded, np.float32(one.data[0].embedding))
    # The client's default asks for base64 and decodes it itself.
    default = client.embeddings.create(model=MINILM, input=SHORT[0])
    assert np.array_equal(default.data[0].embedding, decoded)
    # Alone or in a batch of three: the same vector (to the GEMM's row blocking).
    assert np.allclose(one.data[0].embedding, as_float.data[0].embedding, atol=1e-6)
    ids = reference.tokenize([SHORT[0]])["input_ids"][0].tolist()
    by_ids = client.embeddings.create(model=MINILM, input=[ids], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, as_float.data[0].embedding, atol=1e-6)


def test_bad_requests_are_400s_naming_the_field_and_the_server_keeps_serving(
    server: Server,
) -> None:
    cases = [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a"] * 3000}, "input"),
        ({"input": LONG}, "input"),
        ({"input": [[10**8]]}, "input"),
        ({"input": "a", "dimensions": 100}, "dimensions"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt": "a"}, "input"),
    ]
    for body, field in cases:
        resp = server.post("/v1/embeddings", body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == field, (body, resp.text)
    chat = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
    cut = server.post("/v1/embeddings", {"input": LONG * 1000, "truncate_prompt_tokens": 300})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 256
    stats = wait_idle(server)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_score_and_rerank_are_cosines_of_the_vectors(
    server: Server, reference: SentenceTransformer
) -> None:
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "Berlin is in Germany."]
    query = "What is the capital of France?"
    ref = reference.encode([query, *docs])
    expected = (ref[1:] @ ref[0]).tolist()
    scored = server.post("/v1/score", {"text_1": query, "text_2": docs}).json()
    assert np.allclose([d["score"] for d in scored["data"]], expected, atol=1e-5)
    ranked = server.post("/v1/rerank", {"query": query, "documents": docs, "top_n": 2}).json()
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(expected)[::-1][:2])
    assert ranked["results"][0]["document"]["text"] == docs[0]
    pairs = server.post("/score", {"text_1": ["cat", "car"], "text_2": ["kitten", "truck"]})
    assert pairs.status_code == 200 and len(pairs.json()["data"]) == 2
    bad = server.post("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


def test_the_cli_prints_json_lines(minilm_dir: Path, reference: SentenceTransformer) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "embed", "--model", MINILM, "--dtype", "float32"],
        input="A man is eating food.\nhi\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    lines = [json.loads(line) for line in out]
    assert [line["text"] for line in lines] == ["A man is eating food.", "hi"]
    ref = reference.encode(["A man is eating food.", "hi"])
    assert min(_cosines([line["embedding"] for line in lines], ref)) >= 0.99999


@pytest.fixture
def folder_copy(minilm_dir: Path, tmp_path: Path) -> Path:
    """A copy of the MiniLM folder whose pipeline files a test may break (the weights
    linked, not copied)."""
    target = tmp_path / "model"
    shutil.copytree(minilm_dir, target, ignore=shutil.ignore_patterns("model.safetensors"))
    (target / "model.safetensors").symlink_to(minilm_dir / "model.safetensors")
    return target


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("modules.json", "{not json", "not valid JSON"),
        (
            "modules.json",
            json.dumps([{"type": "x", "path": "../../etc"}]),
            "leaves the model folder",
        ),
        (
            "modules.json",
            json.dumps([{"type": "sentence_transformers.models.Pooling", "path": ""}]),
            "expected a Transformer then one Pooling",
        ),
        ("1_Pooling/config.json", json.dumps({"pooling_mode_max_tokens": True}), "pooling modes"),
        ("sentence_bert_config.json", json.dumps({"max_seq_length": -4}), "max_seq_length"),
    ],
)
def test_a_malformed_pipeline_is_refused_naming_its_file(
    folder_copy: Path, file: str, content: str, message: str
) -> None:
    (folder_copy / file).write_text(content)
    config = config_from_hf(read_json(folder_copy / "config.json"))
    with pytest.raises(ModelFileError, match=message) as err:
        read_pooler(folder_copy, config)
    assert file.split("/")[0] in str(err.value) or "modules.json" in str(err.value)


def test_a_dense_layer_of_the_wrong_shape_is_refused(folder_copy: Path) -> None:
    from safetensors.torch import save_file

    modules = json.loads((folder_copy / "modules.json").read_text())
    modules.insert(
        2, {"idx": 9, "name": "9", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (folder_copy / "modules.json").write_text(json.dumps(modules))
    dense = folder_copy / "2_Dense"
    dense.mkdir()
    (dense / "config.json").write_text(
        json.dumps({"in_features": 384, "out_features": 64, "bias": False})
    )
    save_file({"linear.weight": torch.zeros(64, 100)}, str(dense / "model.safetensors"))
    config = config_from_hf(read_json(folder_copy / "config.json"))
    with pytest.raises(
        ModelFileError, match=r"linear.weight must be a float tensor of \(64, 384\)"
    ):
        read_pooler(folder_copy, config)


# ---- a decoder embeds too -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A small random Llama (transformers) with SmolLM2's tokenizer, and the model."""
    from benchmarks.random_models import SMALL, build_model
    from sluice.loader import load_tokenizer

    directory = tmp_path_factory.mktemp("decoder")
    model = build_model("llama", SMALL, directory)
    _, tok = load_tokenizer("smollm2-135m")
    (directory / "tokenizer.json").write_text(tok.backend.to_str())
    return directory, model


def _hidden(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' final-normed hidden states of one input, [tokens, hidden]."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


def test_a_decoder_embeds_with_its_last_token_beside_generation(
    tiny_decoder: tuple[Path, Any],
) -> None:
    directory, model = tiny_decoder
    # 32-token steps: the 150-token input is computed in chunks, its last one pooled.
    llm = LLM(str(directory), dtype="float32", max_num_batched_tokens=32, max_num_seqs=8)
    texts = ["Rivers run to the sea. " * 25, "hi there"]
    engine = llm.engine
    engine.add_request("gen", "Once upon a time", SamplingParams(max_tokens=8, temperature=0))
    for i, text in enumerate(texts):
        engine.add_request(f"e{i}", text, PoolingParams())
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(done["gen"].outputs[0].token_ids) == 8  # generation ran beside them
    for i in range(len(texts)):
        out = done[f"e{i}"]
        ref = torch.nn.functional.normalize(_hidden(model, out.prompt_token_ids)[-1], dim=0)
        assert (
            torch.nn.functional.cosine_similarity(torch.tensor(out.embedding), ref, dim=0) > 0.99999
        )
        assert abs(float(torch.tensor(out.embedding).norm()) - 1) < 1e-5
    assert len(done["e0"].prompt_token_ids) > 100
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_a_decoder_folder_pooling_the_mean_adds_up_its_chunks(
    tiny_decoder: tuple[Path, Any], tmp_path: Path
) -> None:
    directory, model = tiny_decoder
    folder = tmp_path / "mean"
    shutil.copytree(directory, folder)
    transformer = {
        "idx": 0,
        "name": "0",
        "path": "",
        "type": "sentence_transformers.models.Transformer",
    }
    pooling = {
        "idx": 1,
        "name": "1",
        "path": "1_Pooling",
        "type": "sentence_transformers.models.Pooling",
    }
    (folder / "modules.json").write_text(json.dumps([transformer, pooling]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True})
    )
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    text = "Rivers run to the sea. " * 10
    out = llm.embed(text, use_tqdm=False)[0]
    ref = _hidden(model, out.prompt_token_ids).mean(0)  # no Normalize module: as pooled
    assert len(out.prompt_token_ids) > 40
    assert torch.allclose(torch.tensor(out.outputs.embedding), ref, atol=1e-4)


# ---- the larger models (make test-slow) -------------------------------------------------


def _installed(alias: str) -> bool:
    return installed_parts(KNOWN_MODELS[alias]) is not None


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["all-mpnet-base-v2", "embeddinggemma-300m"])
def test_larger_models_equal_sentence_transformers(alias: str) -> None:
    if not _installed(alias):
        pytest.fail(f"{alias} is not installed: run `make models-extra`")
    path = resolve_model_path(alias)
    reference = SentenceTransformer(str(path), device="cpu")
    # EmbeddingGemma: 900 tokens, past its local layers' 512-token window.
    long = "word and another " * 300
    texts = [*SHORT, long]
    ref = reference.encode(texts)
    for dtype, floor in (("float32", 0.99999), ("bfloat16", 0.999)):
        llm = LLM(alias, dtype=dtype)
        got = llm.embed(texts, PoolingParams(truncate_prompt_tokens=4096), use_tqdm=False)
        assert min(_cosines([o.outputs.embedding for o in got], ref)) >= floor, dtype
    if alias == "embeddinggemma-300m":
        for dims in (512, 256, 128):
            cut = reference.encode(texts, truncate_dim=dims, normalize_embeddings=True)
            got = llm.embed(
                texts, PoolingParams(dimensions=dims, truncate_prompt_tokens=4096), use_tqdm=False
            )
            assert len(got[0].outputs.embedding) == dims
            assert min(_cosines([o.outputs.embedding for o in got], cut)) >= 0.999
