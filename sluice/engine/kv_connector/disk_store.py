"""The disk tier's files: one file per KV block, an LRU index within a size limit, and
a writer thread so that no file is written on the engine loop.

A file is `MAGIC | header length (u32) | header (JSON) | payload | crc32 (u32)`, the
checksum over header and payload. The header names what the bytes mean (model
fingerprint, weight format, dtype, KV dtype, block size, layout, the block's key), so a
file is loaded only where all of it matches; a short, corrupt or foreign file is
deleted and reads as a miss (the block is recomputed). Files are written under a
temporary name and renamed (`os.replace`), so a crash never leaves a half file under a
real name. The index is rebuilt from the directory at start-up (a restart is warm);
its order is least recently used first, and a hit sets the file's mtime so the order
survives the restart too. Any I/O error, a full disk included, is logged once and the
block is skipped: the disk tier only ever costs a recompute.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger("sluice")

MAGIC = b"SLUICEKV"
VERSION = 1
SUFFIX = ".kvblock"
_TMP_PREFIX = ".tmp-"
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class BlockFormat:
    """What a block file's payload means; a file whose format differs is never loaded."""

    model: str  # fingerprint of the weights' file(s)
    quantization: str  # the weights as run (a GGUF's blocks or dense): KV values differ
    dtype: str
    kv_dtype: str
    block_size: int
    layout: str  # the pool's element type and one block's shape, e.g. float32[30,2,3,16,64]
    nbytes: int


@dataclass
class StoreCounters:
    files_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    files_evicted: int = 0
    corrupt_files: int = 0
    write_errors: int = 0
    saves_dropped: int = 0  # the writer's queue was full


class DiskStore:
    """Block files in one directory, at most `max_bytes` of them."""

    def __init__(
        self, directory: Path, max_bytes: int, fmt: BlockFormat, max_queued_bytes: int = 2**28
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.format = fmt
        self.max_queued_bytes = max_queued_bytes
        self.counters = StoreCounters()
        self._header = asdict(fmt)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU first
        self._bytes = 0
        self._queued: dict[str, torch.Tensor] = {}
        self._queued_bytes = 0
        self._warned: set[str] = set()
        directory.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="sluice-kv-disk", daemon=True)
        self._writer.start()
        # A script that ends right after its last request still gets its blocks written.
        atexit.register(_flush_at_exit, weakref.ref(self))

    # ---- the index ------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def _rebuild_index(self) -> None:
        files: list[tuple[float, str, int]] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX) and entry.is_file():
                    st = entry.stat()
                    files.append((st.st_mtime, entry.name[: -len(SUFFIX)], st.st_size))
                elif entry.name.startswith(_TMP_PREFIX):
                    # A writer that died mid-file (an hour is far longer than a write).
                    with contextlib.suppress(OSError):
                        if time.time() - entry.stat().st_mtime > 3600:
                            os.unlink(entry.path)
        for _, key, size in sorted(files):
            self._index[key] = size
            self._bytes += size
        with self._lock:
            self._evict_over_limit()

    def _evict_over_limit(self) -> None:
        """Delete least recently used files until the total fits; the lock is held."""
        while self._bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self.counters.files_evicted += 1
            with contextlib.suppress(OSError):
                os.unlink(self._path(key))

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        with contextlib.suppress(OSError):
            os.unlink(self._path(key))

    def contains(self, key: str) -> bool:
        """On disk, or queued to be written."""
        with self._lock:
            return key in self._index or key in self._queued

    @property
    def num_files(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    # ---- reading ------------------------------------------------------------------------

    def read(self, key: str) -> bytearray | None:
        """The block's payload if its file is there, whole and of this format; else None
        (and a bad file is deleted)."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # the LRU order survives a restart
        except FileNotFoundError:  # deleted under us (the writer's LRU, another engine)
            self._forget(key)
            return None
        except OSError as exc:
            self._warn_once("read", f"reading {path} failed ({exc}); recomputing")
            self._forget(key)
            return None
        payload = self._parse(data, key)
        if payload is None:
            self.counters.corrupt_files += 1
            self._warn_once("corrupt", f"{path} is truncated, corrupt or foreign; recomputing")
            self._forget(key)
            return None
        self.counters.bytes_read += len(payload)
        return payload

    def _parse(self, data: bytes, key: str) -> bytearray | None:
        """The payload of a file's bytes, or None if anything does not check out."""
        head = len(MAGIC) + _LEN.size
        if len(data) < head + _LEN.size or not data.startswith(MAGIC):
            return None
        (header_len,) = _LEN.unpack_from(data, len(MAGIC))
        end = len(data) - _LEN.size
        if head + header_len > end:
            return None
        (crc,) = _LEN.unpack_from(data, end)
        if zlib.crc32(memoryview(data)[head:end]) != crc:
            return None
        try:
            header = json.loads(data[head : head + header_len])
        except ValueError:
            return None
        expected = {"version": VERSION, "key": key, **self._header}
        if header != expected or end - head - header_len != self.format.nbytes:
            return None
        return bytearray(memoryview(data)[head + header_len : end])

    # ---- writing ------------------------------------------------------------------------

    def put(self, key: str, payload: torch.Tensor) -> bool:
        """Queue a block's bytes (a uint8 tensor the caller no longer touches) to be
        written; False if it is there already or the queue is full."""
        n = payload.numel()
        with self._lock:
            if key in self._index or key in self._queued:
                return False
            if self._queued_bytes + n > self.max_queued_bytes or n > self.max_bytes:
                self.counters.saves_dropped += 1
                return False
            self._queued[key] = payload
            self._queued_bytes += n
        self._queue.put(key)
        return True

    def flush(self) -> None:
        """Wait until every queued block is written (or skipped)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
            finally:
                self._queue.task_done()

    def _write(self, key: str) -> None:
        with self._lock:
            payload = self._queued[key]
        size = self._write_file(key, payload.numpy().data)
        with self._lock:
            del self._queued[key]
            self._queued_bytes -= payload.numel()
            if size is None:
                return
            self._index[key] = size
            self._bytes += size
            self.counters.files_written += 1
            self.counters.bytes_written += size
            self._evict_over_limit()

    def _write_file(self, key: str, body: memoryview) -> int | None:
        """Write one block file under its real name at once or not at all; its size, or
        None after an I/O error."""
        header = json.dumps({"version": VERSION, "key": key, **self._header}).encode()
        crc = zlib.crc32(body, zlib.crc32(header))
        tmp = self.directory / f"{_TMP_PREFIX}{key}-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                f.write(body)
                f.write(_LEN.pack(crc))
            os.replace(tmp, self._path(key))
        except OSError as exc:  # a full disk, a read-only or vanished directory, ...
            self.counters.write_errors += 1
            self._warn_once("write", f"writing a KV block to {self.directory} failed ({exc})")
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return None
        return len(MAGIC) + 2 * _LEN.size + len(header) + body.nbytes

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("KV disk tier: %s (more such errors are counted, not logged)", message)


def _flush_at_exit(ref: weakref.ref[DiskStore]) -> None:
    store = ref()
    if store is not None and store._writer.is_alive():
        store.flush()
