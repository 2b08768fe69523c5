"""Models by Hub name (sluice/loader/hub.py, hub_files.py, store.py) downloaded through
the real huggingface_hub from a local stand-in for the Hub (benchmarks/hub_stub.py): GGUF
quantization selection, split GGUF sets, safetensors repos, resuming, corrupted and
missing files, the memory check before downloading, the offline cache, and the
`sluice pull / list / rm` round trip. No test reaches the internet."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
from huggingface_hub import snapshot_download

from benchmarks.hub_stub import HubRepo, HubServer, HubStub
from sluice import LLM, SamplingParams, cli
from sluice.core.errors import ModelFileError, ModelNotFoundError, ModelTooLargeError
from sluice.loader import load_model, resolve_model_path
from sluice.loader.hub_files import (
    HubName,
    RepoFile,
    choose_gguf,
    gguf_choices,
    parse_hub_name,
    quant_tag,
)

GGUF_REPO = "bartowski/SmolLM2-135M-Instruct-GGUF"
ST_REPO = "tiny-org/tiny-llama"
PROMPT = "The capital of France is"


def split_gguf(src: Path, first: Path, parts: int) -> list[Path]:
    """`src` rewritten as a split set (as llama.cpp's gguf-split lays one out): the
    same metadata and tensor bytes, the tensors spread over `parts` files."""
    reader = gguf.GGUFReader(src)
    per_part = -(-len(reader.tensors) // parts)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(first, arch, split_max_tensors=per_part)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(first)


@pytest.fixture(scope="module")
def gguf_files(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The repo's files: the bundled model as Q4_1, and the same model split in two files
    under a second tag (its name says Q8_0; the test needs a second quantization whose
    output is known: a split set of the same weights gives the same tokens)."""
    d = tmp_path_factory.mktemp("gguf-repo")
    parts = split_gguf(smollm2_path, d / "SmolLM2-135M-Instruct-Q8_0.gguf", 2)
    assert [p.name for p in parts] == [
        "SmolLM2-135M-Instruct-Q8_0-00001-of-00002.gguf",
        "SmolLM2-135M-Instruct-Q8_0-00002-of-00002.gguf",
    ]
    (d / "README.md").write_text("# a model card\n")
    return {
        "SmolLM2-135M-Instruct-Q4_1.gguf": smollm2_path,
        **{p.name: p for p in parts},
        "README.md": d / "README.md",
    }


@pytest.fixture(scope="module")
def st_files(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small random Llama in a safetensors repo, with SmolLM2's tokenizer and template."""
    import transformers

    from sluice.loader import load_tokenizer

    d = tmp_path_factory.mktemp("st-repo")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    _, tok = load_tokenizer(str(smollm2_path))
    (d / "tokenizer.json").write_text(tok.backend.to_str())
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": tok.chat_template,
            }
        )
    )
    (d / "pytorch_model.bin").write_bytes(b"never downloaded")
    return {p.name: p for p in d.iterdir() if p.is_file()}


@pytest.fixture
def hub(
    gguf_files: dict[str, Path],
    st_files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[HubStub]:
    stub = HubStub(repos={GGUF_REPO: HubRepo(dict(gguf_files)), ST_REPO: HubRepo(dict(st_files))})
    with HubServer(stub) as served:
        monkeypatch.setenv("HF_ENDPOINT", served.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield served


def _greedy(model: str, n: int = 8) -> list[int]:
    llm = LLM(model=model, dtype="float32", enable_prefix_caching=False, kv_cache_memory=0.1)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0))
    return list(out[0].outputs[0].token_ids)


# -- names and file choice ------------------------------------------------------------


def test_hub_names_parse() -> None:
    assert parse_hub_name("Qwen/Qwen2.5-7B-Instruct") == HubName("Qwen/Qwen2.5-7B-Instruct", None)
    assert parse_hub_name("hf.co/bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M") == HubName(
        "bartowski/Qwen2.5-7B-Instruct-GGUF", "Q4_K_M"
    )
    for not_hub in ("smollm2", "a/b/c", "/abs/path", "../x/y", "a/b:", "a/b:c:d", "models/x.gguf"):
        assert parse_hub_name(not_hub) is None, not_hub


def test_quant_tags() -> None:
    cases = {
        "Qwen2.5-7B-Instruct-Q4_K_M.gguf": "Q4_K_M",
        "SmolLM2-135M-Instruct.Q4_1.gguf": "Q4_1",
        "model-IQ4_XS.gguf": "IQ4_XS",
        "Qwen3-30B-A3B-UD-Q4_K_XL.gguf": "UD-Q4_K_XL",
        "gemma-3-270m-it-bf16.gguf": "BF16",
        "Llama-3.1-8B-Instruct-Q8_0-00001-of-00002.gguf": "Q8_0",
        "Q4_K_M/Mixtral-8x7B-Q4_K_M-00002-of-00003.gguf": "Q4_K_M",
        "ggml-model.gguf": None,
    }
    assert {name: quant_tag(name) for name in cases} == cases


def _files(*names: str, size: int = 10) -> list[RepoFile]:
    return [RepoFile(n, size * (i + 1), None) for i, n in enumerate(names)]


def test_gguf_choice() -> None:
    files = _files(
        "m-Q8_0.gguf",
        "m-Q4_K_M-00001-of-00002.gguf",
        "m-Q4_K_M-00002-of-00002.gguf",
        "m-Q2_K.gguf",
        "mmproj-m-f16.gguf",
        "README.md",
    )
    choices = gguf_choices("o/r", files)
    assert sorted(choices) == ["Q2_K", "Q4_K_M", "Q8_0"]  # the vision projector is no model
    default = choose_gguf(HubName("o/r", None), choices)
    assert default.quant == "Q4_K_M" and len(default.files) == 2
    assert choose_gguf(HubName("o/r", "q8_0"), choices).files[0].name == "m-Q8_0.gguf"
    with pytest.raises(
        ModelNotFoundError, match=r"o/r has no Q5_K_M GGUF; its quantizations: Q2_K"
    ):
        choose_gguf(HubName("o/r", "Q5_K_M"), choices)
    # No Q4_K_M: the smallest.
    smallest = choose_gguf(
        HubName("o/r", None), gguf_choices("o/r", _files("a-Q8_0.gguf", "a-F16.gguf"))
    )
    assert smallest.quant == "Q8_0"
    with pytest.raises(
        ModelNotFoundError, match=r"split in 3 files and the repo lacks part\(s\) \[2\]"
    ):
        gguf_choices("o/r", _files("x-Q4_0-00001-of-00003.gguf", "x-Q4_0-00003-of-00003.gguf"))


# -- downloads ------------------------------------------------------------------------


def test_gguf_quant_downloads_and_runs_like_the_file(hub: HubStub, smollm2_path: Path) -> None:
    path = resolve_model_path(f"{GGUF_REPO}:Q4_1")
    assert path.read_bytes() == smollm2_path.read_bytes()
    assert hub.served[f"{GGUF_REPO}/SmolLM2-135M-Instruct-Q4_1.gguf"] == path.stat().st_size
    assert not any("Q8_0" in k for k in hub.served) and "README.md" not in str(hub.served)
    expected = _greedy(str(smollm2_path))
    assert _greedy(f"{GGUF_REPO}:Q4_1") == expected
    # The split set under the other tag: both parts fetched, loaded as one model.
    first = resolve_model_path(f"{GGUF_REPO}:q8_0")
    assert first.name.endswith("-00001-of-00002.gguf")
    assert (first.parent / first.name.replace("00001-of", "00002-of")).is_file()
    assert _greedy(f"{GGUF_REPO}:Q8_0") == expected
    # Downloaded once: a later start sends no file bytes.
    before = sum(hub.served.values())
    resolve_model_path(f"{GGUF_REPO}:Q4_1")
    assert sum(hub.served.values()) == before


def test_safetensors_repo(
    hub: HubStub, st_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_sluice_test")  # a private repo's reader
    directory = resolve_model_path(ST_REPO)
    assert hub.auth and set(hub.auth) == {"Bearer hf_sluice_test"}
    got = sorted(p.name for p in directory.iterdir())
    assert "model.safetensors" in got and "tokenizer.json" in got and "config.json" in got
    assert "pytorch_model.bin" not in got  # pickles are never fetched
    local = tmp_path / "local"
    local.mkdir()
    for name, src in st_files.items():
        (local / name).write_bytes(src.read_bytes())
    assert _greedy(ST_REPO) == _greedy(str(local))


def test_dropped_connection_resumes(hub: HubStub, smollm2_path: Path) -> None:
    """A connection lost half way: the download continues from where it stopped (a range
    request) rather than from the start, within the call and across runs."""
    key = f"{GGUF_REPO}/SmolLM2-135M-Instruct-Q4_1.gguf"
    size = smollm2_path.stat().st_size
    half = size // 2
    hub.drop_after[key] = half
    hub.refuse_after_drop = True  # the network stays down: this run fails
    with pytest.raises(ModelNotFoundError, match="run again to resume"):
        resolve_model_path(f"{GGUF_REPO}:Q4_1")
    hub.refuse_after_drop = False
    path = resolve_model_path(f"{GGUF_REPO}:Q4_1")  # the next run resumes
    assert path.read_bytes() == smollm2_path.read_bytes()
    # It goes on from what the first run kept (whole chunks of what arrived): only the rest
    # is sent again.
    [(_, start)] = [r for r in hub.ranges if r[0] == key]
    assert 0 < start <= half and hub.served[key] == half + (size - start)
    # Within one call: huggingface_hub resumes a dropped connection by itself.
    other = "SmolLM2-135M-Instruct-Q8_0-00002-of-00002.gguf"
    part_size = (hub.repos[GGUF_REPO].files[other]).stat().st_size
    hub.drop_after[f"{GGUF_REPO}/{other}"] = part_size // 3
    resolve_model_path(f"{GGUF_REPO}:Q8_0")
    [(_, start)] = [r for r in hub.ranges if r[0] == f"{GGUF_REPO}/{other}"]
    assert 0 < start <= part_size // 3


def test_corrupted_download_is_detected_and_removed(hub: HubStub, tmp_path: Path) -> None:
    hub.corrupt.add(f"{GGUF_REPO}/SmolLM2-135M-Instruct-Q4_1.gguf")
    with pytest.raises(ModelFileError, match=r"sha256 is .*the Hub.s is .*removed from the cache"):
        resolve_model_path(f"{GGUF_REPO}:Q4_1")
    cached = [p for p in (tmp_path / "hub").rglob("*.gguf")]
    assert cached == []  # not left looking complete
    hub.corrupt.clear()
    assert resolve_model_path(f"{GGUF_REPO}:Q4_1").is_file()


def test_hostile_file_on_the_hub_is_refused_and_removed(
    hub: HubStub, tmp_path: Path, smollm2_path: Path
) -> None:
    """A file whose hash matches the Hub's record but whose content is malformed (a
    truncated upload) gets the same check as a local file, and is not kept."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(smollm2_path.read_bytes()[:5_000_000])
    hub.repos["evil/model-GGUF"] = HubRepo({"model-Q4_K_M.gguf": bad})
    with pytest.raises(ModelFileError, match=r"past the end .*removed from the cache"):
        resolve_model_path("evil/model-GGUF")
    assert list((tmp_path / "hub").rglob("*.gguf")) == []


def test_missing_things_are_named(hub: HubStub) -> None:
    with pytest.raises(ModelNotFoundError, match="no model repo 'nobody/nothing'"):
        resolve_model_path("nobody/nothing")
    with pytest.raises(ModelNotFoundError, match="has no Q5_K_M GGUF; its quantizations: Q4_1"):
        resolve_model_path(f"{GGUF_REPO}:Q5_K_M")
    with pytest.raises(ModelNotFoundError, match="has no revision 'v9'"):
        resolve_model_path(f"{GGUF_REPO}:Q4_1", revision="v9")
    hub.unserved.add(f"{GGUF_REPO}/SmolLM2-135M-Instruct-Q4_1.gguf")  # listed, then a 404
    with pytest.raises(ModelNotFoundError, match=r"lists SmolLM2-135M-Instruct-Q4_1.gguf but"):
        resolve_model_path(f"{GGUF_REPO}:Q4_1")
    hub.repos["org/empty"] = HubRepo({"README.md": hub.repos[GGUF_REPO].files["README.md"]})
    with pytest.raises(ModelNotFoundError, match=r"org/empty has no config\.json"):
        resolve_model_path("org/empty")
    assert sum(hub.served.values()) == 0


def test_unreachable_hub_is_a_clear_error(hub: HubStub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelNotFoundError, match=r"cannot list .*HF_HUB_OFFLINE=1 uses only"):
        resolve_model_path(f"{GGUF_REPO}:Q4_1")


def test_too_large_is_refused_before_downloading(hub: HubStub) -> None:
    key = f"{GGUF_REPO}/SmolLM2-135M-Instruct-Q4_1.gguf"
    hub.declared_size[key] = 400 * 2**30  # as a 400 GiB file would be listed
    with pytest.raises(
        ModelTooLargeError, match=r"needs about 40\d\.\d GiB .*nothing was downloaded"
    ):
        resolve_model_path(f"{GGUF_REPO}:Q4_1")
    assert hub.served[key] == 0


# -- the offline cache ------------------------------------------------------------------


def test_offline_uses_a_cache_other_tools_filled(
    hub: HubStub, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What sluice fetched, and files fetched by huggingface_hub itself (as transformers or
    the hf CLI fetch them), are found with HF_HUB_OFFLINE=1, nothing reaching the network."""
    cache = os.environ["HF_HUB_CACHE"]
    resolve_model_path(f"{GGUF_REPO}:Q4_1")
    snapshot_download(ST_REPO, cache_dir=cache, endpoint=hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    path = resolve_model_path(f"{GGUF_REPO}:Q4_1")
    assert path.read_bytes() == smollm2_path.read_bytes()
    assert resolve_model_path(ST_REPO).joinpath("config.json").is_file()
    assert load_model(f"{GGUF_REPO}:Q4_1").config.architecture == "llama"
    with pytest.raises(ModelNotFoundError, match=r"has no Q8_0 GGUF; its quantizations: Q4_1"):
        resolve_model_path(f"{GGUF_REPO}:Q8_0")
    with pytest.raises(ModelNotFoundError, match=r"not in the Hub cache .*HF_HUB_OFFLINE"):
        resolve_model_path("someone/uncached")


# -- sluice pull / list / rm ------------------------------------------------------------


def _sluice(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_pull_list_rm_round_trip(hub: HubStub, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _sluice(capsys, "pull", f"{GGUF_REPO}:Q8_0")
    assert code == 0, err
    assert out.strip().endswith("-Q8_0-00001-of-00002.gguf")
    assert _sluice(capsys, "pull", ST_REPO)[0] == 0
    listed = _sluice(capsys, "list")[1]
    rows = {line.split()[0]: line.split() for line in listed.splitlines()[1:]}
    assert rows[f"{GGUF_REPO}:Q8_0"][1:] == ["0.10", "GB", "Q8_0", "llama", "hub"]
    assert rows[ST_REPO][3:] == ["BF16", "LlamaForCausalLM", "hub"]
    assert rows["smollm2-135m"][-1] == "packaged"
    code, out, _ = _sluice(capsys, "rm", f"{GGUF_REPO}:Q8_0")
    assert code == 0 and out.count("removed") == 2
    assert _sluice(capsys, "rm", ST_REPO)[0] == 0
    listed = _sluice(capsys, "list")[1]
    assert GGUF_REPO not in listed and ST_REPO not in listed
    code, _, err = _sluice(capsys, "rm", ST_REPO)
    assert code == 2 and "not in the Hub cache" in err
    code, _, err = _sluice(capsys, "pull", f"{GGUF_REPO}:Q4_1", "--kv-cache-memory", "100000")
    assert code == 2 and "nothing was downloaded" in err


def test_split_set_by_path(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    """A split set is named by its first file; a missing part or another part named is
    an error that says so."""
    first, second = (n for n in gguf_files if "-of-" in n)
    (tmp_path / first).symlink_to(gguf_files[first])
    with pytest.raises(ModelFileError, match=r"part\(s\) \['.*-00002-of-00002.gguf'\] are missing"):
        load_model(str(tmp_path / first))
    (tmp_path / second).symlink_to(gguf_files[second])
    with pytest.raises(ModelFileError, match="is part 2 of a split model: load part 1"):
        load_model(str(tmp_path / second))
    assert load_model(str(tmp_path / first)).config.num_layers == 30
