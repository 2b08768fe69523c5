"""GGUF and safetensors files are untrusted input: each hostile variant ends in one
ModelFileError that names the file and its defect, before the loader believes
any count or offset; random byte flips, header lengths and truncations (hypothesis) end
the same way, never in numpy's, gguf's or safetensors' internals, a crash or a hang.
`make fuzz` runs the random part far longer."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.core.errors import ModelFileError
from sluice.loader.gguf_check import check_gguf, check_gguf_data
from sluice.loader.gguf_loader import load_gguf_header
from sluice.loader.gguf_metadata import GGUFMetadata

F32, Q4_0 = 0, 2
STRING, ARRAY, UINT32 = 8, 9, 4


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        raw = value if isinstance(value, bytes) else value.encode()
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    return struct.pack("<I", value)


def build(
    kvs: list[tuple[str, int, Any]] | None = None,
    tensors: list[tuple[str, list[int], int, int]] | None = None,
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    counts: tuple[int, int] | None = None,
    alignment: int = 32,
    data_bytes: int = 512,
) -> bytes:
    """A GGUF file: its keys (name, type, value), tensors (name, dims, type, offset)."""
    kvs = [("general.architecture", STRING, "llama")] if kvs is None else kvs
    tensors = [("a", [32, 2], F32, 0), ("b", [32], F32, 256)] if tensors is None else tensors
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    out = magic + struct.pack("<IQQ", version, n_tensors, n_kv)
    for key, vtype, value in kvs:
        out += _value(STRING, key) + struct.pack("<I", vtype) + _value(vtype, value)
    for name, dims, ttype, offset in tensors:
        out += _value(STRING, name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, offset)
    out += b"\0" * (-len(out) % alignment)
    return out + b"\0" * data_bytes


def test_a_well_formed_file_passes() -> None:
    spans = check_gguf_data(build(), "f.gguf")
    assert [(s.name, s.end - s.start) for s in spans] == [("a", 256), ("b", 128)]


def _big_dims(n: int) -> list[int]:
    return [32] + [1] * (n - 1)


HOSTILE: list[tuple[str, bytes, str]] = [
    ("empty magic", b"GG", "the GGUF magic needs 4 bytes"),
    ("bad magic", build(magic=b"GGML"), "not a GGUF file"),
    ("version 1", build(version=1), "version 1 is not supported"),
    ("2^62 tensors", build(counts=(1 << 62, 1)), "the tensor count is 4,611,686,018,427,387,904"),
    ("2^62 keys", build(counts=(2, 1 << 62)), "the metadata key count is"),
    ("truncated header", build()[:30], "truncated download?"),
    ("truncated data", build()[:-200], "tensor b ends at byte 544"),
    ("offset past the end", build(tensors=[("a", [32], F32, 1 << 40)]), "truncated download?"),
    ("dimension product", build(tensors=[("a", [1 << 40, 1 << 40], F32, 0)]), "more than 2^50"),
    ("zero dimension", build(tensors=[("a", [32, 0], F32, 0)]), "a dimension of 0"),
    ("100 dimensions", build(tensors=[("a", _big_dims(100), F32, 0)]), "has 100 dimensions"),
    ("unknown type", build(tensors=[("a", [32], 999, 0)]), "type 999, which is not a known"),
    ("negative type", build(tensors=[("a", [32], 0xFFFFFFFF, 0)]), "type 4294967295"),
    ("partial block", build(tensors=[("a", [33], Q4_0, 0)]), "not a whole number of 32-value"),
    ("misaligned", build(tensors=[("a", [32], F32, 8)]), "not a multiple of the file's alignment"),
    ("overlap", build(tensors=[("a", [64], F32, 0), ("b", [32], F32, 128)]), "overlap"),
    ("same tensor", build(tensors=[("a", [32], F32, 0), ("a", [32], F32, 128)]), "appears twice"),
    ("same key", build(kvs=[("k", UINT32, 1), ("k", UINT32, 2)]), "the key 'k' appears twice"),
    ("alignment 3", build(kvs=[("general.alignment", UINT32, 3)]), "not a power of two"),
    ("value type 13", build(kvs=[("k", 13, 0)]), "value type 13, which GGUF does not define"),
    ("huge string", build(kvs=[("k", STRING, "x")])[:-1].replace(
        struct.pack("<Q", 1) + b"x", struct.pack("<Q", 1 << 60) + b"x"), "needs"),
    ("huge key", build(kvs=[("k" * 70_000, UINT32, 1)]), "at most 65,535"),
    ("huge array", build(kvs=[("k", ARRAY, (UINT32, []))]).replace(
        struct.pack("<IQ", UINT32, 0), struct.pack("<IQ", UINT32, 1 << 61)), "element count"),
    ("nested arrays", build(kvs=[("k", ARRAY, (ARRAY, [(ARRAY, [(ARRAY, [(ARRAY, [(ARRAY,
        [])])])])]))]), "nests arrays more than 4 deep"),
    ("not UTF-8", build(kvs=[("k\xff", UINT32, 1)]).replace("k\xff".encode(), b"k\xff"),
     "key #0 is not UTF-8"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "raw", "defect"), HOSTILE, ids=[c for c, _, _ in HOSTILE])
def test_hostile_files_name_their_defect(
    tmp_path: Path, case: str, raw: bytes, defect: str
) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(raw)
    with pytest.raises(ModelFileError) as info:
        check_gguf(path)
    assert defect in str(info.value) and str(path) in str(info.value), info.value
    assert isinstance(info.value, ValueError)
    # The loader's own entry point checks first, so it says the same.
    with pytest.raises(ModelFileError, match=r"hostile\.gguf"):
        load_gguf_header(path)


def _reference_fields(path: Path) -> tuple[dict[str, Any], list[Any]]:
    """Every key's value and the tensors as the `gguf` library's reader gives them."""
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, reader.tensors


def assert_reads_as_the_gguf_library(path: Path) -> None:
    meta = GGUFMetadata.of(path)
    fields, tensors = _reference_fields(path)
    assert meta.keys() == list(fields)
    for key, want in fields.items():
        got = meta.get(key)
        if key == "t.nested":  # the library's contents() flattens nested arrays
            assert got == [[1, 2], [3]] and want == [1, 2, 3]
            continue
        assert type(got) is type(want) and got == want, key
    assert [t.name for t in meta.tensors] == [t.name for t in tensors]
    for ours, theirs in zip(meta.tensors, tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert (ours.data_offset, ours.n_bytes) == (theirs.data_offset, theirs.n_bytes)
        data = meta.tensor_data(ours)
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape
        assert np.array_equal(data.view(np.uint8), np.asarray(theirs.data).view(np.uint8))


def test_the_header_reader_reads_what_the_gguf_library_reads(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """The loader's reader (gguf_check's walk, values decoded on demand) against the
    `gguf` library's: the bundled model, and a file with every value type, nested
    arrays and tensors of plain and block types."""
    assert_reads_as_the_gguf_library(smollm2_path)
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for name, add, value in [("u8", writer.add_uint8, 200), ("i8", writer.add_int8, -3),
                             ("u16", writer.add_uint16, 60_000), ("i16", writer.add_int16, -2),
                             ("u32", writer.add_uint32, 4_000_000_000),
                             ("i32", writer.add_int32, -70_000), ("f32", writer.add_float32, 0.1),
                             ("u64", writer.add_uint64, 1 << 60), ("i64", writer.add_int64, -5),
                             ("f64", writer.add_float64, 0.1), ("yes", writer.add_bool, True),
                             ("text", writer.add_string, "héllo ▁ 😀")]:  # fmt: skip
        add(f"t.{name}", value)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1e-30])
    writer.add_array("t.texts", ["a", "", "ü"])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 32), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    q8 = rng.integers(0, 255, (2, 2 * 34), dtype=np.uint8)  # 2 rows of two Q8_0 blocks
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_as_the_gguf_library(path)
    assert GGUFMetadata.of(path).tensor_data(GGUFMetadata.of(path).tensors[2]).shape == (2, 68)


def test_a_value_that_is_not_utf8_names_its_key(tmp_path: Path) -> None:
    kvs = [("general.architecture", STRING, "llama"),
           ("tokenizer.ggml.tokens", ARRAY, (STRING, [b"a", b"\xff\xfe"]))]  # fmt: skip
    path = tmp_path / "bad-text.gguf"
    path.write_bytes(build(kvs))
    meta = GGUFMetadata.of(path)  # the structure is sound
    assert meta.get("general.architecture") == "llama"
    with pytest.raises(ModelFileError, match=r"'tokenizer\.ggml\.tokens'\[1\] is not UTF-8"):
        meta.get("tokenizer.ggml.tokens")


def test_the_bundled_model_truncated_anywhere(smollm2_path: Path, tmp_path: Path) -> None:
    raw = smollm2_path.read_bytes()
    assert check_gguf_data(raw, "ok")  # the real file passes
    spans = check_gguf_data(raw, "ok")
    header_end = min(s.start for s in spans)
    for cut in (10, 20, 30, 1_000, 100_000, header_end - 3, header_end + 5, len(raw) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(raw[:cut])
        with pytest.raises(ModelFileError, match=r"truncated download\?"):
            GGUFMetadata.of(path)
    with pytest.raises(ModelFileError, match="empty"):
        (tmp_path / "empty.gguf").write_bytes(b"")
        check_gguf(tmp_path / "empty.gguf")


# 300 examples in the default run; `make fuzz` runs the "fuzz" profile (conftest.py).
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 900)),
)
def test_random_flips_and_cuts_end_in_model_file_error(
    flips: list[tuple[int, int]], cut: int | None
) -> None:
    kvs = [("general.architecture", STRING, "llama"), ("general.alignment", UINT32, 32),
           ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "bb", "<s>"]))]  # fmt: skip
    raw = bytearray(build(kvs))
    for pos, xor in flips:
        if pos < len(raw):
            raw[pos] ^= xor
    data = bytes(raw if cut is None else raw[:cut])
    try:
        check_gguf_data(data, "fuzz.gguf")
    except ModelFileError as exc:
        assert str(exc).startswith("fuzz.gguf: ")
        return
    # A file the check lets through: the reader and every value read end well or in
    # ModelFileError too.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.gguf"
        path.write_bytes(data)
        try:
            meta = GGUFMetadata.of(path)
            for key in meta.keys():
                meta.get(key)
        except ModelFileError:
            pass  # the documented error: what the check let through, the reader refused


# ---- safetensors ------------------------------------------------------------------------


def test_hostile_safetensors_name_the_file(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from sluice.loader.hf_loader import _load_shard

    good = tmp_path / "good.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(good))
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    variants = {
        "truncated": raw[:-10],
        "huge header": struct.pack("<Q", 1 << 60) + raw[8:],
        "header not JSON": raw[:8] + b"}" * n + raw[8 + n :],
        "empty": b"",
    }
    for case, data in variants.items():
        path = tmp_path / f"{case}.safetensors"
        path.write_bytes(data)
        with pytest.raises(ModelFileError, match="not a valid safetensors file") as info:
            dict(_load_shard(path))  # read tensor by tensor
        assert str(path) in str(info.value), case
    assert dict(_load_shard(good))["w"].shape == (4, 4)


def _safetensors_bytes() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"w": torch.arange(12, dtype=torch.float32).view(3, 4),
                 "b": torch.ones(5, dtype=torch.bfloat16)})  # fmt: skip


SAFETENSORS = _safetensors_bytes()


# The header (its length, then JSON naming each tensor's dtype, shape and offsets) is
# what a hostile file lies in: flips land there, cuts anywhere.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, 8 + 120), st.integers(1, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, len(SAFETENSORS))),
    length=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_random_safetensors_headers_end_in_model_file_error(
    flips: list[tuple[int, int]], cut: int | None, length: int | None
) -> None:
    from sluice.loader.hf_loader import _load_shard, check_safetensors

    raw = bytearray(SAFETENSORS)
    if length is not None:
        raw[:8] = struct.pack("<Q", length)
    for pos, xor in flips:
        if pos < len(raw):
            raw[pos] ^= xor
    data = bytes(raw if cut is None else raw[:cut])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.safetensors"
        path.write_bytes(data)
        try:
            check_safetensors(path)
            tensors = dict(_load_shard(path))
        except ModelFileError as exc:
            assert str(path) in str(exc)
            return
    # What loads is what the header declares: whole tensors of its shapes.
    for t in tensors.values():
        assert t.numel() * t.element_size() <= len(data)


# ---- a model directory's tokenizer files --------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    from sluice.loader import load_tokenizer

    return load_tokenizer("smollm2-135m")[1].backend.to_str()


def _hf_dir(root: Path, tokenizer_json: str, files: dict[str, bytes]) -> Path:
    (root / "tokenizer.json").write_text(tokenizer_json)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


HOSTILE_TOKENIZER_FILES = [
    ("tokenizer.json", b'{"version": "1.0", "model": ', "not a valid tokenizer file"),
    ("tokenizer_config.json", b"[1, 2]", "not a JSON object"),
    ("tokenizer_config.json", b"\xff\xfe{}", "not valid JSON"),
    ("tokenizer_config.json", b"[" * 100_000, "not valid JSON"),
    ("tokenizer_config.json", b'{"chat_template": 3}', "chat_template must be"),
    ("tokenizer_config.json", b'{"chat_template": [{"name": "x"}]}', "chat_template must be"),
    ("config.json", b'{"eos_token_id": "2"}', "eos_token_id must be token ids"),
    ("config.json", b'{"eos_token_id": [2, 10000000]}', "eos_token_id must be token ids"),
    ("generation_config.json", b'{"eos_token_id": -1}', "eos_token_id must be token ids"),
]


@pytest.mark.parametrize(("name", "data", "says"), HOSTILE_TOKENIZER_FILES)
def test_hostile_tokenizer_files_name_the_file(
    tmp_path: Path, tokenizer_json: str, name: str, data: bytes, says: str
) -> None:
    from sluice.loader.tokenizer import Tokenizer

    directory = _hf_dir(tmp_path, tokenizer_json, {})
    (directory / name).write_bytes(data)
    with pytest.raises(ModelFileError, match=says) as info:
        Tokenizer.from_hf_dir(directory)
    assert str(directory / name) in str(info.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
TOKENIZER_KEYS = ["bos_token", "eos_token", "chat_template", "add_bos_token", "eos_token_id",
                  "bos_token_id"]  # fmt: skip


# Each example parses SmolLM2's 2 MB tokenizer.json: a sixth of the profile's examples.
@settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    max_examples=max(10, settings.default.max_examples // 6),
)
@given(
    configs=st.fixed_dictionaries(
        {},
        optional={
            name: st.dictionaries(st.sampled_from(TOKENIZER_KEYS), json_values, max_size=4)
            for name in ("tokenizer_config.json", "config.json", "generation_config.json")
        },
    ),
    flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), max_size=3),
)
def test_random_tokenizer_files_load_or_name_the_file(
    tokenizer_json: str, configs: dict[str, Any], flips: list[tuple[int, int]]
) -> None:
    from sluice.loader.tokenizer import Tokenizer

    raw = bytearray(tokenizer_json.encode())
    for pos, xor in flips:
        raw[pos] ^= xor
    with tempfile.TemporaryDirectory() as tmp:
        files = {name: json.dumps(value).encode() for name, value in configs.items()}
        directory = _hf_dir(Path(tmp), "", files)
        (directory / "tokenizer.json").write_bytes(bytes(raw))
        try:
            tok = Tokenizer.from_hf_dir(directory)
        except ModelFileError as exc:
            assert exc.path.startswith(str(directory)), exc
            return
    vocab = tok.backend.get_vocab_size()
    assert all(isinstance(i, int) and 0 <= i < vocab for i in tok.eos_token_ids)
    assert tok.chat_template is None or isinstance(tok.chat_template, str)
    tok.encode("Hello, world")
