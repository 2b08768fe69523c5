"""A real `sluice serve` process for tests: started on a free port with an API key,
waited on until healthy, stopped with SIGTERM (which must exit 0).

Shared by the server tests and the playground's browser test, so both drive the same
command line a user runs.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-123"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def post(self, path: str, body: Any = None, *, content: bytes | None = None) -> httpx.Response:
        if content is None:
            content = json.dumps(body).encode()
        headers = {**self.headers, "Content-Type": "application/json"}
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name and labels (model_name left out)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(srv: Server, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if srv.proc.poll() is not None:
            pytest.fail(f"sluice serve exited with {srv.proc.returncode}:\n{srv.log.read_text()}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet: poll again
        if time.monotonic() > deadline:
            srv.proc.kill()
            pytest.fail(f"sluice serve did not become healthy:\n{srv.log.read_text()}")
        time.sleep(0.3)


@contextmanager
def serve(*args: str) -> Iterator[Server]:
    """`sluice serve --api-key API_KEY *args` on a free port, healthy, until the block ends."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="sluice-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--port", str(port), "--api-key", API_KEY]
    with log.open("wb") as out:
        proc = subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        _wait_healthy(srv)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            assert rc == 0, log.read_text()
    log.unlink(missing_ok=True)


def wait_idle(server: Server, timeout: float = 30.0) -> dict[str, Any]:
    """Engine stats once nothing runs or waits (the KV pool should then be all free),
    or the last stats seen when `timeout` runs out."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{server.url}/stats", headers=server.headers, timeout=10).json()
        if stats["num_requests"] == 0 and stats["kv_free_blocks"] == stats["kv_total_blocks"]:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.1)
