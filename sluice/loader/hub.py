"""Models by Hub name, fetched through huggingface_hub into its standard cache.

huggingface_hub does the transfer: its cache layout (so files other tools fetched are
reused), the HTTP requests with their retries, a progress bar, and HF_TOKEN,
HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE. What is ours: which files a name means
(hub_files.py), what they will cost in memory, checked before a byte is downloaded
(memory.py), keeping a partial download across runs, and checking what arrived (sha256
against the Hub's record, then the same structure checks a local file gets) before
anything uses it. A file that fails is removed from the cache, never left looking
complete.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import httpx2
from filelock import FileLock
from huggingface_hub import HfApi, constants, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # documented there

from sluice.core.errors import ModelFileError, ModelNotFoundError, ModelTooLargeError
from sluice.settings import cache_dir

from .gguf_check import check_gguf
from .hf_loader import check_safetensors, read_json
from .hub_files import (
    HubName,
    RepoFile,
    choose_gguf,
    gguf_choices,
    safetensors_files,
)
from .memory import GIB, RUNTIME_OVERHEAD, MemoryBudget, machine_memory

logger = logging.getLogger(__name__)

_BYTES_PER_DTYPE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def offline() -> bool:
    """HF_HUB_OFFLINE (read now, not when huggingface_hub was imported)."""
    return constants.HF_HUB_OFFLINE or _truthy(os.environ.get("HF_HUB_OFFLINE"))


def hub_cache() -> Path:
    """huggingface_hub's cache directory, by its own rules, read now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _repo_dir(repo_id: str) -> Path:
    return hub_cache() / ("models--" + repo_id.replace("/", "--"))


@dataclass(frozen=True)
class Listing:
    """A repo's files at one commit, from the Hub or from the cache."""

    commit: str
    files: list[RepoFile]


def _remote_listing(name: HubName, revision: str | None) -> Listing:
    """The repo's files, sizes and hashes as the Hub states them; a Hub error as a
    ModelNotFoundError naming the repo."""
    where = _endpoint() or constants.ENDPOINT
    try:
        info = HfApi(endpoint=_endpoint()).model_info(
            name.repo_id, revision=revision, files_metadata=True
        )
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{name.repo_id} is gated: accept its terms on the Hub, then set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{name.repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"no model repo {name.repo_id!r} on {where} (private? set HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, OSError, httpx2.HTTPError) as exc:
        raise ModelNotFoundError(
            f"cannot list {name.repo_id} on {where}: {exc}. Offline, HF_HUB_OFFLINE=1 uses "
            "only what is already cached"
        ) from None
    files = [
        RepoFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None)
        for s in info.siblings or []
    ]
    return Listing(str(info.sha), files)


def _cached_listing(name: HubName, revision: str | None) -> Listing:
    """The repo's files the cache holds at `revision` (a branch, tag or commit)."""
    repo = _repo_dir(name.repo_id)
    ref = repo / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else (revision or "")
    snapshot = repo / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        raise ModelNotFoundError(
            f"{name} is not in the Hub cache ({hub_cache()}) and HF_HUB_OFFLINE is set: "
            f"run `sluice pull {name}` where the Hub can be reached"
        )
    return Listing(commit, snapshot_files(snapshot))


def snapshot_files(snapshot: Path) -> list[RepoFile]:
    """The files a cache snapshot holds; an LFS file's sha256 is its blob's name."""
    files = []
    for path in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        blob = path.resolve().name
        sha = blob if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob) else None
        files.append(RepoFile(path.relative_to(snapshot).as_posix(), path.stat().st_size, sha))
    return files


def _wanted(name: HubName, listing: Listing) -> tuple[str, list[RepoFile]]:
    """What `name` means in the listing: ("gguf" or "safetensors", the files)."""
    choices = gguf_choices(name.repo_id, listing.files)
    if choices or name.quant is not None:
        return "gguf", list(choose_gguf(name, choices).files)
    return "safetensors", safetensors_files(name.repo_id, listing.files)


def _weight_memory(kind: str, files: list[RepoFile], config: dict[str, object]) -> int:
    """Bytes the loaded weights take: a GGUF's stay as stored; safetensors weights are
    held in float32 while they load."""
    weights = sum(f.size for f in files if f.name.endswith((".gguf", ".safetensors")))
    if kind == "gguf":
        return weights
    stored = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return weights * 4 // _BYTES_PER_DTYPE.get(stored, 2)


def check_fits(name: HubName, weight_bytes: int, download: int, budget: MemoryBudget) -> None:
    """Refuse, before downloading, a model this machine cannot hold."""
    need, have = budget.need(weight_bytes), machine_memory()
    logger.info(
        "%s: %.2f GB to download; it needs about %.1f GiB of memory (weights %.1f GiB, "
        "KV cache %.1f GiB); this machine has %.1f GiB",
        name,
        download / 1e9,
        need / GIB,
        weight_bytes / GIB,
        budget.kv_cache_bytes / GIB,
        have / GIB,
    )
    if need > have:
        raise ModelTooLargeError(
            f"{name} needs about {need / GIB:.1f} GiB of memory (weights {weight_bytes / GIB:.1f}"
            f" GiB, KV cache {budget.kv_cache_bytes / GIB:.1f} GiB, runtime "
            f"{RUNTIME_OVERHEAD / GIB:.1f} GiB) and this machine has {have / GIB:.1f} GiB; "
            "nothing was downloaded. Choose a smaller quantization (org/repo:Q4_K_M) or a "
            "smaller --kv-cache-memory"
        )


def forget_file(path: Path) -> None:
    """Remove a cached file: the snapshot's link and the blob it points at."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path:
        blob.unlink(missing_ok=True)


def _verify(path: Path, file: RepoFile, digest: str | None) -> None:
    """The file's content against the Hub's sha256, then its structure, once per blob
    (a marker records a verified blob by size and mtime: re-hashing GBs at every start
    would cost seconds). `digest`: the blob's sha256 when the download computed it on
    the way. A file that fails is removed from the cache."""
    blob = path.resolve()
    st = blob.stat()
    marker = cache_dir() / "hub-verified" / blob.name
    stamp = f"{file.sha256} {st.st_size} {st.st_mtime_ns}"
    if marker.is_file() and marker.read_text() == stamp:
        return
    try:
        if file.sha256 is not None:  # an LFS file: the Hub records its sha256
            if digest is None or blob.name != file.sha256:
                with open(blob, "rb") as f:
                    digest = _sha256_of(f, st.st_size).hexdigest()
            if digest != file.sha256:
                raise ModelFileError(
                    str(path), f"the download's sha256 is {digest}, the Hub's is {file.sha256}"
                )
        if file.name.endswith(".gguf"):
            check_gguf(path)
        elif file.name.endswith(".safetensors"):
            check_safetensors(path)
    except ModelFileError as exc:
        forget_file(path)
        raise ModelFileError(
            exc.path, f"{exc.defect}; removed from the cache, download it again"
        ) from None
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(stamp)


class _HashingFile:
    """A file that hashes what is written to it: the download's sha256 comes with the
    transfer, not from a second pass over gigabytes. huggingface_hub's http_get writes,
    and truncates to the start when a server ignores the range it asked for."""

    def __init__(self, f: BinaryIO, prefix_hash: hashlib._Hash) -> None:
        self.f = f
        self.hash = prefix_hash

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.f.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        if (size if size is not None else self.f.tell()) != 0:
            raise OSError("a download can only be restarted from its first byte")
        self.hash = hashlib.sha256()
        return self.f.truncate(size)


def _fetch_blob(name: HubName, commit: str, file: RepoFile) -> str | None:
    """An LFS file's blob, resumable across runs; its sha256 when it was downloaded now.
    huggingface_hub resumes a dropped connection within one call but starts a file anew
    after the process ends (Ctrl-C, a crash); for a 5 GB GGUF that is minutes, so the
    partial download is kept beside the blobs, under a lock, and continued with a range
    request. hf_hub_download then finds the blob and only links it into the snapshot."""
    assert file.sha256 is not None
    blobs = _repo_dir(name.repo_id) / "blobs"
    if (blobs / file.sha256).is_file():
        return None
    blobs.mkdir(parents=True, exist_ok=True)
    partial = blobs / f"{file.sha256}.sluice-partial"
    url = hf_hub_url(name.repo_id, file.name, revision=commit, endpoint=_endpoint())
    with FileLock(blobs / f"{file.sha256}.sluice-lock"):
        if (blobs / file.sha256).is_file():  # another process finished it meanwhile
            return None
        with open(partial, "a+b") as f:
            done = f.seek(0, os.SEEK_END)
            if done > file.size:  # not a prefix of this file: start over
                done = f.seek(0)
                f.truncate()
            if done:
                logger.info("%s: resuming %s at %.2f GB", name, file.name, done / 1e9)
            prefix = _sha256_of(f, done)
            out = _HashingFile(f, prefix)
            http_get(
                url,
                cast(BinaryIO, out),
                resume_size=done,
                headers=build_hf_headers(),
                expected_size=file.size,
                displayed_filename=file.name,
            )
        os.replace(partial, blobs / file.sha256)
        return out.hash.hexdigest()


def _sha256_of(f: BinaryIO, n: int) -> hashlib._Hash:
    """The running hash of a file's first n bytes (a resumed download's prefix); the file
    is left at its end."""
    h = hashlib.sha256()
    f.seek(0)
    while n > 0 and (chunk := f.read(min(1 << 24, n))):
        h.update(chunk)
        n -= len(chunk)
    f.seek(0, os.SEEK_END)
    return h


def _fetch(name: HubName, commit: str, file: RepoFile) -> tuple[Path, str | None]:
    """One file into the cache: its snapshot path, and its sha256 if the download
    computed it."""
    try:
        digest = None
        if file.sha256 is not None and not offline():
            digest = _fetch_blob(name, commit, file)
        path = hf_hub_download(
            name.repo_id,
            file.name,
            revision=commit,
            cache_dir=hub_cache(),
            endpoint=_endpoint(),
            local_files_only=offline(),
        )
        return Path(path), digest
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise ModelNotFoundError(
            f"{name}: {file.name} is not in the Hub cache and HF_HUB_OFFLINE is set"
        ) from None
    except RemoteEntryNotFoundError:
        raise ModelNotFoundError(
            f"{name}: the Hub lists {file.name} but does not serve it (404)"
        ) from None
    except (HfHubHTTPError, OSError, httpx2.HTTPError) as exc:
        raise ModelNotFoundError(
            f"{name}: downloading {file.name} failed ({exc}); run again to resume"
        ) from None


def hub_model_path(
    name: HubName, revision: str | None = None, budget: MemoryBudget | None = None
) -> Path:
    """The local path of a Hub model (the first file of a GGUF set, or a safetensors
    snapshot directory), downloading what the cache lacks after checking it fits."""
    listing = _cached_listing(name, revision) if offline() else _remote_listing(name, revision)
    kind, files = _wanted(name, listing)
    fetched: dict[str, tuple[Path, str | None]] = {}
    if kind == "safetensors":  # the config first: the estimate reads its dtype
        config_file = next(f for f in files if f.name == "config.json")
        fetched["config.json"] = _fetch(name, listing.commit, config_file)
    config = read_json(fetched["config.json"][0]) if fetched else {}
    missing = sum(f.size for f in files if not _snapshot(name, listing.commit, f).is_file())
    check_fits(name, _weight_memory(kind, files, config), missing, budget or MemoryBudget())
    for f in files:
        if f.name not in fetched:
            fetched[f.name] = _fetch(name, listing.commit, f)
        path, digest = fetched[f.name]
        _verify(path, f, digest)
    if not offline():
        _record_ref(name, revision or "main", listing.commit)
    first = fetched[files[0].name][0]
    return first if kind == "gguf" else first.parent


def _record_ref(name: HubName, revision: str, commit: str) -> None:
    """Point the cache's refs/<revision> at the commit the files came from, as the Hub
    cache's layout has it, so that HF_HUB_OFFLINE later finds them by the same name (the
    files are fetched by commit, which leaves no ref)."""
    if revision == commit:
        return
    ref = _repo_dir(name.repo_id) / "refs" / revision
    if ref.resolve().is_relative_to(_repo_dir(name.repo_id).resolve()):
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)


def _snapshot(name: HubName, commit: str, file: RepoFile) -> Path:
    return _repo_dir(name.repo_id) / "snapshots" / commit / file.name


__all__ = ["check_fits", "forget_file", "hub_cache", "hub_model_path", "offline", "snapshot_files"]
