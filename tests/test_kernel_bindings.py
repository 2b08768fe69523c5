"""The Python bindings of our C++ kernels match the kernels: every declared signature
equals its `extern "C"` prototype in sluice/kernels/csrc/*.cpp, every exported function
is declared, the decode stack's table has the fields the library names, and ctypes and
raw pointers stay inside sluice/kernels."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice import kernels
from sluice.attention import SDPABackend
from sluice.config import ModelConfig
from sluice.kernels import _ffi, cpu, decode_stack
from sluice.layers.linear import Linear
from sluice.layers.quantization import Int4WeightOnly, Int8WeightOnly
from sluice.models.llama import LlamaForCausalLM
from sluice.models.llama_decode_stack import LlamaDecodeStack, layer_fields
from tests.conftest import kernels_at

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "sluice" / "kernels" / "csrc"

# C types of the prototypes -> what ctypes must be told. Pointers are checked apart:
# `char*` is a string, any other `T*` a plain address.
C_TYPES: dict[str, type[Any] | None] = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}


def c_type(text: str) -> type[Any] | None:
    """The ctypes type of a C type as written in a prototype (`const int64_t*`)."""
    bare = re.sub(r"\bconst\b", "", text).replace(" ", "")
    if bare == "char*":
        return ctypes.c_char_p
    if bare.endswith("*"):
        return ctypes.c_void_p
    if bare not in C_TYPES:
        raise AssertionError(f"no ctypes mapping for the C type {text!r}: add one here")
    return C_TYPES[bare]


def _strip_comments(source: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.DOTALL)


def _extern_c_headers(source: str) -> Iterator[str]:
    """The text before each body (or `;`) at the top level of every `extern "C"` block,
    and the one declaration after a block-less `extern "C"`."""
    for m in re.finditer(r'extern\s+"C"\s*', source):
        i = m.end()
        if source[i] != "{":  # extern "C" <one declaration>
            yield source[i:].split(";")[0].split("{")[0]
            continue
        depth, header = 0, []
        for ch in source[i + 1 :]:
            if depth == 0 and ch == "}":
                break
            if ch == "{":
                if depth == 0:
                    yield "".join(header)
                    header = []
                depth += 1
            elif ch == "}":
                depth -= 1
            elif depth == 0:
                if ch == ";":
                    yield "".join(header)
                    header = []
                else:
                    header.append(ch)


def c_prototypes() -> dict[str, tuple[type[Any] | None, tuple[type[Any] | None, ...]]]:
    """name -> (ctypes restype, ctypes argtypes) of every exported C function."""
    found: dict[str, tuple[type[Any] | None, tuple[type[Any] | None, ...]]] = {}
    for path in sorted(CSRC.glob("*.cpp")):
        for header in _extern_c_headers(_strip_comments(path.read_text())):
            m = re.fullmatch(r"\s*(.+?)\s*\b(\w+)\s*\(([^()]*)\)\s*", header, flags=re.DOTALL)
            if m is None:
                continue  # not a function (a variable, a using-declaration)
            ret, name, args = m.groups()
            params = [] if args.strip() in ("", "void") else args.split(",")
            argtypes = []
            for param in params:
                # Drop the parameter's name: `const int64_t* fields` -> `const int64_t*`.
                typ = re.fullmatch(r"\s*(.*?)\s*\b\w+\s*", param, flags=re.DOTALL)
                assert typ is not None and typ.group(1), f"{path.name}: {name}({args})"
                argtypes.append(c_type(typ.group(1)))
            assert name not in found, f"{name} is exported twice"
            found[name] = (c_type(ret), tuple(argtypes))
    return found


PROTOTYPES = c_prototypes()
DECLARED = _ffi.declared()  # every binding module's, as importing sluice.kernels made them


def test_the_parser_reads_the_prototypes() -> None:
    # Guard against a parser that passes because it finds nothing.
    assert len(PROTOTYPES) >= 13
    assert PROTOTYPES["sluice_variant"] == (ctypes.c_char_p, ())
    assert PROTOTYPES["sluice_fused_max_dim"] == (ctypes.c_int, ())
    restype, args = PROTOTYPES["sluice_decode_stack"]
    assert restype is None and len(args) == 35 and args[9:11] == (ctypes.c_float,) * 2
    assert args[21] == ctypes.c_int  # kv_int8: the pools hold int8 rows
    assert args[29] == ctypes.c_float  # residual_scale: Granite's sublayer factor
    assert args[30] == ctypes.c_int  # gemm_min_rows: where the int8 GEMM takes over
    assert args[31] == ctypes.c_int  # gemm_tiles: that GEMM on AMX-INT8 tiles
    # softmax_after_top_k, then the clamped SwiGLU's alpha and limit (gpt-oss)
    assert args[32:] == (ctypes.c_int, ctypes.c_float, ctypes.c_float)
    assert PROTOTYPES["sluice_write_kv"][1][2] == ctypes.c_int64


def test_every_exported_function_is_declared() -> None:
    assert sorted(set(PROTOTYPES) - set(DECLARED)) == []


def test_every_declared_function_exists() -> None:
    assert sorted(set(DECLARED) - set(PROTOTYPES)) == []


@pytest.mark.parametrize("name", sorted(PROTOTYPES))
def test_declared_signature_matches_the_prototype(name: str) -> None:
    restype, argtypes = PROTOTYPES[name]
    fn = DECLARED[name]
    assert len(fn.argtypes) == len(argtypes), f"{name}: argument count"
    for i, (declared, prototype) in enumerate(zip(fn.argtypes, argtypes, strict=True)):
        assert declared is prototype, f"{name}: argument {i} is {prototype}, declared {declared}"
    assert fn.restype is restype, f"{name}: returns {restype}, declared {fn.restype}"


def test_loaded_libraries_carry_the_declarations(kernel_level: str) -> None:
    lib = kernels.load()
    assert lib is not None and kernels.built_level(lib) == kernel_level
    for name, fn in DECLARED.items():
        c_fn = getattr(lib, name)
        assert c_fn.restype is fn.restype and list(c_fn.argtypes) == list(fn.argtypes), name


def test_ctypes_and_raw_pointers_stay_in_the_kernels_package() -> None:
    kernels_dir = ROOT / "sluice" / "kernels"
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "sluice").rglob("*.py"))
        if kernels_dir not in path.parents
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bctypes\b|\bdata_ptr\(", line)
    ]
    assert offenders == []


# The decode stack's per-layer table.


def tiny_model(method: type[Int4WeightOnly | Int8WeightOnly]) -> LlamaForCausalLM:
    """Two Qwen2-style layers (QKV bias) with every linear on our int4 or int8 kernel."""
    config = ModelConfig(
        architecture="qwen2",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        attention_bias=True,
    )
    model = LlamaForCausalLM(config)
    torch.manual_seed(0)
    for module in model.layers.modules():
        if isinstance(module, Linear):
            module.weight.normal_()
            module.method = method()
            module.method.process_weight(module)
            assert module.method.lib is not None  # on our kernel, or this tests nothing
    return model


def kv_caches(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = model.config
    shape = (4, c.num_kv_heads, 16, c.head_dim)  # [blocks, kv_heads, block_size, d]
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]


@pytest.fixture
def active_kernels() -> Iterator[kernels.Library]:
    with kernels_at(cpu.level()):
        lib = kernels.load()
        assert lib is not None
        yield lib


@pytest.mark.parametrize("method", [Int4WeightOnly, Int8WeightOnly])
def test_python_fills_the_fields_the_library_names(
    method: type[Int4WeightOnly | Int8WeightOnly], active_kernels: kernels.Library
) -> None:
    names = decode_stack.field_names(active_kernels)
    assert len(names) == len(set(names)) > 0
    model = tiny_model(method)
    caches = kv_caches(model)
    for layer, (k, v) in zip(model.layers, caches, strict=True):
        found = layer_fields(layer, k, v, torch.float32)
        assert found is not None
        assert found[0] == {4 if method is Int4WeightOnly else 8}
        assert sorted(found[1]) == sorted(names)
    # The built stack's table follows the library's order, column by column.
    stack = LlamaDecodeStack.build(model, SDPABackend(active_kernels), caches)
    assert stack is not None
    assert stack.table.names == names
    assert tuple(stack.table.pointers.shape) == (2, len(names))
    for layer, (k, v), row in zip(model.layers, caches, stack.table.tensors, strict=True):
        found = layer_fields(layer, k, v, torch.float32)
        assert found is not None
        assert all(t is found[1][name] for t, name in zip(row, names, strict=True))
    nulls = stack.table.pointers[:, [names.index(n) for n in ("qkv_min", "o_min")]]
    assert bool((nulls == 0).all()) == (method is Int8WeightOnly)  # int8 has no minimums


def test_layer_table_rejects_unknown_and_missing_fields(active_kernels: kernels.Library) -> None:
    names = decode_stack.field_names(active_kernels)
    t = torch.zeros(1)
    full: dict[str, torch.Tensor | None] = dict.fromkeys(names, t)
    decode_stack.LayerTable(active_kernels, [full])  # fine
    with pytest.raises(ValueError, match="qkv_bias"):
        decode_stack.LayerTable(active_kernels, [{n: t for n in names if n != "qkv_bias"}])
    with pytest.raises(ValueError, match="qkv_gate"):
        decode_stack.LayerTable(active_kernels, [{**full, "qkv_gate": t}])


def test_a_compiler_that_fails_leaves_torch_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed compile of any source (the sources compile in parallel, then link) is a
    warning with the compiler's message and no library, never a half-built one cached."""
    cxx = tmp_path / "cxx"
    cxx.write_text("#!/bin/sh\necho 'cc1plus: error: out of tea' >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="sluice"):
        assert kernels._build("generic") is None
    assert "out of tea" in caplog.text
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


def test_builds_started_together_compile_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Builders of one level that start together (test workers, data-parallel replicas,
    `kernels.build`'s threads) wait on the cache's file lock: one compiles, the others
    load its library. The stand-in compiler logs each source it compiles, waits a
    little so the builders overlap, and links by copying the real generic library."""
    real = kernels.load("generic")
    assert real is not None
    log = tmp_path / "compiled.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo stand-in 1.0; exit 0; }\n'
        'for a; do case "$a" in *.cpp) echo "$a" >> "$LOG"; sleep 0.2;; esac; done\n'
        'for a; do out="$a"; done\n'
        'case "$out" in *.so) cp "$REAL" "$out";; *) : > "$out";; esac\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("LOG", str(log))
    monkeypatch.setenv("REAL", real._name)
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    with ThreadPoolExecutor(max_workers=3) as pool:
        libs = list(pool.map(kernels._build, ["generic"] * 3))
    assert all(lib is not None and kernels.built_level(lib) == "generic" for lib in libs)
    sources = sorted((CSRC).glob("*.cpp"))
    assert len(log.read_text().splitlines()) == len(sources)  # one build's worth
    cache = tmp_path / "cache" / "kernels"
    assert len(list(cache.glob("*.so"))) == 1
    # A cached library loads without the lock (a read-only shared cache still works).
    for lock in cache.glob("*.lock"):
        lock.unlink()
    assert kernels._build("generic") is not None
    assert not list(cache.glob("*.lock"))
    assert len(log.read_text().splitlines()) == len(sources)
    with pytest.raises(ValueError, match="cannot run the sse9 kernels"):
        kernels.build(["sse9"])
