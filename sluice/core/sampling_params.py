"""Per-request sampling options, validated once at the API boundary.

Defaults follow vLLM's SamplingParams so OpenAI-style clients behave as they expect.
Everything is checked in ``__post_init__`` so the engine and the sampler can trust the
values (and their types) without re-checking on the hot path.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, TypeGuard

from sluice.core.errors import SamplingParamsError
from sluice.core.kv_transfer import check_kv_transfer_params
from sluice.core.structured_output import StructuredOutput

# Below this the softmax is numerically a one-hot, so sample with argmax instead.
_GREEDY_EPS = 1e-5
_MAX_LOGPROBS = 20
# Stop strings are checked against the output's tail after every token: their number
# and length bound that work (vLLM has no bound; 100,000 strings once passed here).
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


def _is_int(value: object) -> TypeGuard[Integral]:
    # bool is an int subclass, but True as "max_tokens" is a client bug, not 1.
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[Real]:
    return isinstance(value, Real) and not isinstance(value, bool)


def _int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    if not _is_int(value):
        raise SamplingParamsError(
            name, f"{name} must be an int, got {type(value).__name__} {value!r}"
        )
    result = int(value)
    if minimum is not None and result < minimum:
        raise SamplingParamsError(name, f"{name} must be >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise SamplingParamsError(name, f"{name} must be <= {maximum}, got {result}")
    return result


def _float(name: str, value: object) -> float:
    if not _is_number(value):
        raise SamplingParamsError(
            name, f"{name} must be a number, got {type(value).__name__} {value!r}"
        )
    result = float(value)
    if not math.isfinite(result):
        raise SamplingParamsError(name, f"{name} must be a finite number, got {result}")
    return result


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(
            name, f"{name} must be a bool, got {type(value).__name__} {value!r}"
        )
    return value


def _optional_logprobs(name: str, value: object) -> int | None:
    if value is None:
        return None
    return _int(name, value, minimum=0, maximum=_MAX_LOGPROBS)


@dataclass
class SamplingParams:
    """How to sample one request's output; invalid values raise SamplingParamsError.

    After construction ``stop`` is always a ``list[str]``, ``stop_token_ids`` a
    ``list[int]``, ``top_k`` is 0 when disabled and ``logit_bias`` (if set) has int keys.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: generate up to the context window
    min_tokens: int = 0
    temperature: float = 1.0  # 0 (or < 1e-5): greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N per token; 0: only the sampled token's logprob
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # The output must match this (a StructuredOutput; a dict of its fields is
    # converted to one).
    structured_output: StructuredOutput | None = None
    # Prefill/decode disaggregation (sluice/core/kv_transfer.py): ask a prefill
    # instance to hold the prompt's KV blocks, or tell a decode instance where they are.
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Checked in field order so the first bad field is the one reported.
        self.n = _int("n", self.n, minimum=1)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, minimum=1)
        self.min_tokens = _int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )

        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamsError(
                "temperature", f"temperature must be >= 0, got {self.temperature:g}"
            )

        top_k = _int("top_k", self.top_k, minimum=-1)
        self.top_k = 0 if top_k == -1 else top_k

        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p:g}")

        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p:g}")

        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty:g}",
            )

        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value:g}")
            setattr(self, name, value)

        if self.seed is not None:
            self.seed = _int("seed", self.seed, minimum=_SEED_MIN, maximum=_SEED_MAX)

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.logprobs = _optional_logprobs("logprobs", self.logprobs)
        self.prompt_logprobs = _optional_logprobs("prompt_logprobs", self.prompt_logprobs)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self.structured_output = self._normalise_structured_output(self.structured_output)
        self.kv_transfer_params = check_kv_transfer_params(self.kv_transfer_params)

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple):
            raise SamplingParamsError(
                "stop", f"stop must be a str or a list of str, got {type(stop).__name__}"
            )
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                "stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop):,}"
            )
        for s in stop:
            if not isinstance(s, str):
                raise SamplingParamsError(
                    "stop", f"stop must contain only str, got {type(s).__name__} {s!r}"
                )
            # An empty stop string would match at position 0 and end every request at once.
            if not s:
                raise SamplingParamsError("stop", "stop must not contain empty strings")
            if len(s) > MAX_STOP_CHARS:
                raise SamplingParamsError(
                    "stop",
                    f"a stop string may be at most {MAX_STOP_CHARS} characters, got {len(s):,}",
                )
        return list(stop)  # a fresh list: clones must not share it

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple):
            raise SamplingParamsError(
                "stop_token_ids",
                f"stop_token_ids must be a list of int, got {type(ids).__name__}",
            )
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                "stop_token_ids",
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids):,}",
            )
        return [_int("stop_token_ids", i, minimum=0) for i in ids]

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise SamplingParamsError(
                "logit_bias", f"logit_bias must be a dict, got {type(bias).__name__}"
            )
        result: dict[int, float] = {}
        for key, value in bias.items():
            # JSON object keys are always strings, so OpenAI clients send {"50256": -100}.
            if isinstance(key, str) and key.isascii() and key.isdigit():
                token_id = int(key)
            elif _is_int(key) and int(key) >= 0:
                token_id = int(key)
            else:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias keys must be token ids (int >= 0), got {key!r}"
                )
            b = _float("logit_bias", value)
            if not -100.0 <= b <= 100.0:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {b:g}"
                )
            result[token_id] = b
        return result

    @staticmethod
    def _normalise_structured_output(value: object) -> StructuredOutput | None:
        if value is None or isinstance(value, StructuredOutput):
            return value
        if not isinstance(value, dict):
            raise SamplingParamsError(
                "structured_output",
                f"structured_output must be a StructuredOutput or a dict, got "
                f"{type(value).__name__}",
            )
        return StructuredOutput.from_dict(value)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied; lists and dicts are not shared."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"SamplingParams has no field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)
