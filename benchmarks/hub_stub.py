"""A local stand-in for the Hugging Face Hub: the HTTP routes huggingface_hub calls to
list a repo and download its files, served from files on disk, so that the tests of
sluice/loader/hub.py (and benchmarks/hub_download.py) download through the real library
without the internet.

Routes: GET /api/models/{repo}[/revision/{rev}] (the listing, with sizes and LFS sha256
when ?blobs=true), HEAD and GET /{repo}/resolve/{rev}/{path} (ranges honoured), and the
Hub's 404s with X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound). Faults for
the tests: a file's bytes corrupted in transit, a connection dropped part way, a size
declared other than the file's.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


@dataclass
class HubRepo:
    files: dict[str, Path]  # repo path -> the file served
    commit: str = ""
    lfs: frozenset[str] = frozenset()  # which files are LFS (.gguf, .safetensors by default)

    def __post_init__(self) -> None:
        if not self.commit:
            self.commit = hashlib.sha1(repr(sorted(self.files)).encode()).hexdigest()

    def is_lfs(self, name: str) -> bool:
        return name in self.lfs or name.endswith((".gguf", ".safetensors"))


@dataclass
class HubStub:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)  # "repo/path": one byte flipped when served
    drop_after: dict[str, int] = field(default_factory=dict)  # "repo/path": bytes, then hang up
    refuse_after_drop: bool = False  # after a drop, answer that file's requests with a 503
    declared_size: dict[str, int] = field(default_factory=dict)  # "repo/path": size listed
    unserved: set[str] = field(default_factory=set)  # "repo/path": listed, but a 404
    served: Counter[str] = field(default_factory=Counter)  # "repo/path": bytes sent
    ranges: list[tuple[str, int]] = field(default_factory=list)  # ("repo/path", first byte)
    auth: list[str | None] = field(default_factory=list)  # each request's Authorization
    url: str = ""

    hashes: dict[Path, str] = field(default_factory=dict)

    def sha256(self, path: Path) -> str:
        if path not in self.hashes:
            self.hashes[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self.hashes[path]

    def listing(self, repo_id: str, repo: HubRepo) -> dict[str, Any]:
        siblings = []
        for name, path in sorted(repo.files.items()):
            size = self.declared_size.get(f"{repo_id}/{name}", path.stat().st_size)
            entry: dict[str, Any] = {"rfilename": name, "size": size, "blobId": "0" * 40}
            if repo.is_lfs(name):
                entry["lfs"] = {"sha256": self.sha256(path), "size": size, "pointerSize": 134}
            siblings.append(entry)
        return {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "siblings": siblings}

    def tree(self, repo: HubRepo) -> list[dict[str, Any]]:
        """The recursive file tree (what snapshot_download lists), one page."""
        entries = []
        for name, path in sorted(repo.files.items()):
            size = path.stat().st_size
            entry: dict[str, Any] = {"type": "file", "path": name, "size": size, "oid": "0" * 40}
            if repo.is_lfs(name):
                entry["lfs"] = {"oid": self.sha256(path), "size": size, "pointerSize": 134}
            entries.append(entry)
        return entries


def _handler(hub: HubStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            return  # no line per request on stderr: the tests read the stub's counters

        def _error(self, status: int, code: str, commit: str | None = None) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _find(self, repo_id: str, rev: str) -> HubRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound")
            elif rev not in ("main", repo.commit):
                self._error(404, "RevisionNotFound")
                repo = None
            return repo

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            hub.auth.append(self.headers.get("Authorization"))
            url = urlparse(self.path)
            path = unquote(url.path)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path)
            if m:
                repo = self._find(m[1], m[2])
                if repo is not None:
                    self._json(hub.tree(repo), body)
                return
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                repo = self._find(m[1], m[2] or "main")
                if repo is not None:
                    self._json(hub.listing(m[1], repo), body)
                return
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                self._error(404, "NotFound")
                return
            repo = self._find(m[1], m[2])
            if repo is None:
                return
            if m[3] not in repo.files or f"{m[1]}/{m[3]}" in hub.unserved:
                self._error(404, "EntryNotFound", repo.commit)
                return
            self._file(m[1], repo, m[3], body)

        def _json(self, value: Any, body: bool) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _file(self, repo_id: str, repo: HubRepo, name: str, body: bool) -> None:
            key, path = f"{repo_id}/{name}", repo.files[name]
            size = path.stat().st_size
            if hub.refuse_after_drop and body and key not in hub.drop_after and hub.served[key]:
                self._error(503, "Unavailable")
                return
            start = 0
            if m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
                start = int(m[1])
                hub.ranges.append((key, start))
            etag = hub.sha256(path) if repo.is_lfs(name) else f"git-{size}"
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            if body:
                self._send_bytes(key, path, start, size)

        def _send_bytes(self, key: str, path: Path, start: int, size: int) -> None:
            """Bytes start.. of the file in chunks; a planted fault applied on the way."""
            cut = hub.drop_after.pop(key, None)
            end = size if cut is None else min(size, start + cut)
            with open(path, "rb") as f:
                f.seek(start)
                pos = start
                while pos < end:
                    chunk = f.read(min(1 << 20, end - pos))
                    if key in hub.corrupt and pos + len(chunk) == size:
                        chunk = chunk[:-1] + bytes([chunk[-1] ^ 0xFF])
                    self.wfile.write(chunk)
                    pos += len(chunk)
                    hub.served[key] += len(chunk)
            if cut is not None:
                self.wfile.flush()
                self.close_connection = True

    return Handler


class HubServer:
    """The stub served on a local port, in a thread."""

    def __init__(self, hub: HubStub) -> None:
        self.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        hub.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStub:
        self.thread.start()
        return self.hub

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _serve(hub: HubStub, port: Any) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    port.put(server.server_address[1])
    server.serve_forever()


class HubProcess:
    """The stub in a process of its own, as a remote server would be: a benchmark's
    client then shares no interpreter lock with it. (Its counters stay in that process.)"""

    def __init__(self, hub: HubStub) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.port = ctx.Queue()
        self.process = ctx.Process(target=_serve, args=(hub, self.port), daemon=True)

    def __enter__(self) -> str:
        self.process.start()
        return f"http://127.0.0.1:{self.port.get(timeout=60)}"

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.join()
