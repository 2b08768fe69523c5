"""Moving held KV blocks from a prefill instance to a decode instance over TCP.

The prefill side runs a `BlockServer`: a listening socket and a thread per connection.
A finished prompt's blocks are copied out of the pool into it (`reserve`, then `put`
per block) under a transfer id, and stay there until the decode side confirms it has
them, until the connection that was sending them breaks (the decode instance went
away), or until `timeout` seconds passed without either (it never came). So the
prefill pool itself is never held hostage by a slow or dead decode instance: its blocks
go back at once, and what waits is a copy with a size limit and a deadline.

The protocol is four messages on one connection, each a length-prefixed frame:
the decode side asks `{"transfer_id", "format"}`; the prefill side answers
`{"ok", "format", "token_ids", "num_blocks"}` (or `{"ok": false, "error"}`), then the
blocks' bytes back to back; the decode side answers `{"done": true}`. Both sides
compare the BlockFormat (model fingerprint, weight format, dtype, KV dtype, block
size, layout): blocks of another model or precision are refused, never loaded. TCP's
own checksums cover the bytes; unlike the disk tier, nothing here outlives a process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from sluice.engine.kv_connector.disk_store import BlockFormat
from sluice.engine.stats import PDPrefillStats

logger = logging.getLogger("sluice")

_LEN = struct.Struct("<I")
_MAX_HEADER = 2**24  # a header names at most a prompt's token ids


class TransferError(RuntimeError):
    """A pull that did not bring the blocks (refused, gone, broken, timed out)."""


def send_json(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes, or ConnectionError if the peer closed first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def recv_json(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > _MAX_HEADER:
        raise ConnectionError(f"a {n}-byte header is not from a sluice KV transfer")
    message = json.loads(recv_exact(sock, n))
    if not isinstance(message, dict):
        raise ConnectionError("a KV transfer message must be a JSON object")
    return message


@dataclass
class _Held:
    token_ids: list[int]
    num_blocks: int
    deadline: float
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ServerCounters:
    sent_transfers: int = 0  # confirmed by the decode side
    expired_transfers: int = 0  # nobody came before the deadline
    broken_transfers: int = 0  # the decode side went away mid-transfer
    refused_pulls: int = 0  # unknown id, or another block format
    dropped_holds: int = 0  # over max_bytes: the decode side computes the prompt
    bytes_sent: int = 0


class BlockServer:
    """Held transfers and the TCP server that hands them out (the prefill side)."""

    def __init__(
        self, host: str, port: int, fmt: BlockFormat, timeout: float, max_bytes: int = 2**32
    ) -> None:
        self.format = fmt
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.counters = ServerCounters()
        self._fmt = asdict(fmt)
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.create_server((host, port))
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        for target, name in ((self._accept_loop, "accept"), (self._expire_loop, "expire")):
            threading.Thread(target=target, name=f"sluice-kv-{name}", daemon=True).start()

    # ---- what the engine holds --------------------------------------------------------

    def reserve(self, transfer_id: str, token_ids: list[int], num_blocks: int) -> bool:
        """Make room for a transfer's blocks; False if that would pass max_bytes."""
        with self._lock:
            if (self._num_blocks_locked() + num_blocks) * self.format.nbytes > self.max_bytes:
                self.counters.dropped_holds += 1
                return False
            deadline = time.monotonic() + self.timeout
            self._held[transfer_id] = _Held(list(token_ids), num_blocks, deadline)
            return True

    def put(self, transfer_id: str, index: int, block: torch.Tensor) -> None:
        """One block's bytes (a uint8 CPU tensor nobody else writes)."""
        with self._lock:
            held = self._held.get(transfer_id)
            if held is not None:
                held.blocks[index] = block

    def _num_blocks_locked(self) -> int:
        return sum(h.num_blocks for h in self._held.values())

    def stats(self) -> PDPrefillStats:
        c = self.counters
        with self._lock:
            blocks = self._num_blocks_locked()
            transfers = len(self._held)
        return PDPrefillStats(
            pd_held_transfers=transfers,
            pd_held_blocks=blocks,
            pd_held_bytes=blocks * self.format.nbytes,
            pd_sent_transfers=c.sent_transfers,
            pd_expired_transfers=c.expired_transfers,
            pd_broken_transfers=c.broken_transfers,
            pd_refused_pulls=c.refused_pulls,
            pd_dropped_holds=c.dropped_holds,
            pd_bytes_sent=c.bytes_sent,
        )

    def _release(self, transfer_id: str, counter: str) -> None:
        """Drop a transfer's blocks (once: the first reason counts)."""
        with self._lock:
            if self._held.pop(transfer_id, None) is not None:
                setattr(self.counters, counter, getattr(self.counters, counter) + 1)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            # shutdown wakes the thread blocked in accept(); close alone may not.
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            self._held.clear()

    # ---- threads ----------------------------------------------------------------------

    def _expire_loop(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            now = time.monotonic()
            with self._lock:
                late = [t for t, h in self._held.items() if h.deadline < now]
            for tid in late:
                self._release(tid, "expired_transfers")
                logger.warning("KV transfer %s expired: no decode instance pulled it", tid)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(conn,), name="sluice-kv-send", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        tid: str | None = None
        with conn:
            try:
                conn.settimeout(self.timeout)
                ask = recv_json(conn)
                tid = str(ask.get("transfer_id"))
                held = self._check(conn, tid, ask.get("format"))
                if held is None:
                    return
                self._send(conn, held)
                if recv_json(conn).get("done") is True:
                    self._release(tid, "sent_transfers")
                    return
            except (OSError, ValueError) as exc:
                logger.warning("KV transfer %s broke off: %s", tid, exc)
            if tid is not None:
                # The decode side went away (or said something else): nobody else will
                # pull this transfer, so its blocks go now, not at the deadline.
                self._release(tid, "broken_transfers")

    def _check(self, conn: socket.socket, tid: str, fmt: object) -> _Held | None:
        """The transfer if it is here, whole, and the asker's format is ours; else the
        asker hears why (and the transfer stays for a right one, until its deadline)."""
        with self._lock:
            held = self._held.get(tid)
        error = None
        if fmt != self._fmt:
            error = f"block format differs: this prefill instance has {self._fmt}, asked {fmt}"
        elif held is None:
            error = f"no KV transfer {tid!r} here (never made, already pulled, or expired)"
        elif len(held.blocks) != held.num_blocks:
            error = f"KV transfer {tid!r} is incomplete"
        if error is not None:
            self.counters.refused_pulls += 1
            send_json(conn, {"ok": False, "error": error})
            return None
        return held

    def _send(self, conn: socket.socket, held: _Held) -> None:
        header = {"ok": True, "format": self._fmt, "token_ids": held.token_ids}
        send_json(conn, {**header, "num_blocks": held.num_blocks})
        for i in range(held.num_blocks):
            block = held.blocks[i]
            # The tensor's own bytes, without a copy (a uint8 tensor: one byte each).
            conn.sendall(memoryview(block.numpy().data))
            self.counters.bytes_sent += block.numel()


def fetch_blocks(
    host: str, port: int, transfer_id: str, fmt: BlockFormat, timeout: float
) -> tuple[list[int], bytearray, int]:
    """Pull a held transfer: (the token ids its blocks hold, their bytes back to back,
    the number of blocks). Raises TransferError with the reason on any failure."""
    want = asdict(fmt)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            send_json(sock, {"transfer_id": transfer_id, "format": want})
            reply = recv_json(sock)
            if not reply.get("ok"):
                raise TransferError(str(reply.get("error", "refused")))
            if reply.get("format") != want:
                raise TransferError(f"block format differs: {reply.get('format')} vs {want}")
            num_blocks = int(reply["num_blocks"])
            data = recv_exact(sock, num_blocks * fmt.nbytes)
            send_json(sock, {"done": True})
    except (OSError, ValueError, KeyError) as exc:
        raise TransferError(f"pulling KV from {host}:{port} failed: {exc}") from exc
    return [int(t) for t in reply["token_ids"]], data, num_blocks
