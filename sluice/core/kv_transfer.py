"""`kv_transfer_params`: what a request carries between a prefill and a decode instance.

The shape follows vLLM's field of the same name, so an OpenAI client (or a proxy) only
passes a dict along:

- to the prefill instance: `{"do_remote_decode": true}`: compute the prompt and hold
  its KV blocks for a decode instance to pull;
- from the prefill instance's response, to the decode instance: `{"do_remote_prefill":
  true, "remote_host", "remote_port", "transfer_id", "num_blocks"}`: where the blocks
  wait.

It lives in core because SamplingParams validates it at the API boundary and both the
server and the engine's connectors read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.core.errors import SamplingParamsError

PARAM = "kv_transfer_params"
_KEYS = {"do_remote_decode", "do_remote_prefill", "remote_host", "remote_port"}
_KEYS |= {"transfer_id", "num_blocks"}


@dataclass(frozen=True)
class RemotePrefill:
    """Where a prefill instance holds a request's KV blocks."""

    host: str
    port: int
    transfer_id: str
    num_blocks: int


def _fail(message: str) -> SamplingParamsError:
    return SamplingParamsError(PARAM, f"{PARAM}: {message}")


def check_kv_transfer_params(value: object) -> dict[str, Any] | None:
    """The params, checked (unknown keys and wrong types are the client's error)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _fail(f"must be an object, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in _KEYS)
    if unknown:
        raise _fail(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(value.get(flag, False), bool):
            raise _fail(f"{flag} must be a bool")
    if value.get("do_remote_decode") and value.get("do_remote_prefill"):
        raise _fail("do_remote_decode and do_remote_prefill exclude each other")
    if value.get("do_remote_prefill"):
        _remote(value)  # every field of the address must be there and well formed
    return dict(value)


def _remote(value: dict[str, Any]) -> RemotePrefill:
    host, port = value.get("remote_host"), value.get("remote_port")
    tid, num = value.get("transfer_id"), value.get("num_blocks")
    if not isinstance(host, str) or not host:
        raise _fail("remote_host must be a non-empty string")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise _fail(f"remote_port must be a port number, got {port!r}")
    if not isinstance(tid, str) or not 0 < len(tid) <= 200:
        raise _fail("transfer_id must be a string of 1 to 200 characters")
    if not isinstance(num, int) or isinstance(num, bool) or num < 0:
        raise _fail(f"num_blocks must be an integer >= 0, got {num!r}")
    return RemotePrefill(host, port, tid, num)


def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """Where the request's prompt blocks wait, if a prefill instance holds them."""
    if not params or not params.get("do_remote_prefill"):
        return None
    return _remote(params)


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """Whether the request asks this (prefill) instance to hold its prompt's blocks."""
    return bool(params and params.get("do_remote_decode"))
