"""What the front end and a replica say to each other; plain picklable dataclasses, so
a pipe (mp) and Ray's object store (ray) carry them alike.

Front end -> replica: AddRequest, AbortRequest, LoadAdapter, UnloadAdapter, Stop.
Replica -> front end: Ready (or StartFailed) once, then Accepted/Rejected for each add,
AdapterDone for each adapter command, Outputs after each step, StepFailed when a step
raises, and Stopped last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.core.lora import LoRARequest
from sluice.core.request import RequestParams
from sluice.outputs import RequestOutput


@dataclass
class AddRequest:
    request_id: str
    prompt: list[int]
    params: RequestParams
    priority: int
    # Seconds since the request arrived at the front end: monotonic clocks differ
    # between machines, so the replica takes its own clock minus this.
    age: float
    # The LoRA adapter it runs through (every replica serves the lora_modules).
    lora_request: LoRARequest | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class LoadAdapter:
    """Serve a LoRA adapter loaded at run time (POST /v1/load_lora_adapter)."""

    token: int  # AdapterDone's; 0: nobody waits for the answer
    request: LoRARequest


@dataclass
class UnloadAdapter:
    """Stop serving an adapter (its running requests finish)."""

    token: int
    name: str


@dataclass
class Stop:
    """Abort everything and exit."""


Command = AddRequest | AbortRequest | LoadAdapter | UnloadAdapter | Stop


@dataclass
class Ready:
    pid: int
    max_model_len: int
    stats: dict[str, Any]


@dataclass
class StartFailed:
    error: BaseException


@dataclass
class Accepted:
    request_ids: list[str]
    stats: dict[str, Any]


@dataclass
class Rejected:
    request_id: str
    error: BaseException


@dataclass
class Outputs:
    outputs: list[RequestOutput]
    stats: dict[str, Any]


@dataclass
class StepFailed:
    request_ids: list[str]
    message: str
    stats: dict[str, Any]


@dataclass
class AdapterDone:
    """A LoadAdapter or UnloadAdapter's answer: the error, else whether it changed
    anything (an unload of an adapter the replica did not serve did not)."""

    token: int
    error: BaseException | None
    changed: bool


@dataclass
class Stopped:
    """The replica aborted its requests and is exiting."""


Event = Ready | StartFailed | Accepted | Rejected | AdapterDone | Outputs | StepFailed | Stopped
