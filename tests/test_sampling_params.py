"""SamplingParams: every invalid value names its field, valid values are normalised."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sluice.sampling_params import SamplingParams, SamplingParamsError

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"n": 1.0}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 16.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": False}, "min_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop": {"a"}}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": False}, "prompt_logprobs"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {1: -100.5}}, "logit_bias"),
    ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"logit_bias": {1: "5"}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {True: 1}}, "logit_bias"),
    ({"logit_bias": {1.0: 1}}, "logit_bias"),
    ({"logit_bias": [(1, 1.0)]}, "logit_bias"),
]


@pytest.mark.parametrize(("kwargs", "param"), INVALID, ids=[repr(k) for k, _ in INVALID])
def test_invalid_values_name_the_field(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingParams(**kwargs)
    assert excinfo.value.param == param
    assert param in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


def test_message_format() -> None:
    with pytest.raises(SamplingParamsError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.temperature == 1.0
    assert p.top_k == 0
    assert p.top_p == 1.0
    assert p.min_p == 0.0
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.seed is None
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert p.prompt_logprobs is None
    assert p.skip_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.logit_bias is None
    assert not p.greedy


def test_normalisation() -> None:
    p = SamplingParams(
        temperature=0,
        top_k=-1,
        top_p=1,
        stop="\n\n",
        stop_token_ids=(7, 9),
        logit_bias={"50": -100, 3: 2},
        max_tokens=None,
        min_tokens=1000,
    )
    assert isinstance(p.temperature, float) and p.temperature == 0.0
    assert isinstance(p.top_p, float)
    assert p.top_k == 0
    assert p.stop == ["\n\n"]
    assert p.stop_token_ids == [7, 9]
    assert p.logit_bias == {50: -100.0, 3: 2.0}
    assert all(isinstance(k, int) for k in p.logit_bias)
    assert all(isinstance(v, float) for v in p.logit_bias.values())
    assert p.max_tokens is None  # min_tokens is unbounded when max_tokens is
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_boundary_values_are_valid() -> None:
    p = SamplingParams(
        top_p=1e-9,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=0,
        prompt_logprobs=20,
        logit_bias={0: 100, 1: -100},
        seed=-1,
        min_tokens=16,
        max_tokens=16,
        top_k=50,
        repetition_penalty=1e-3,
    )
    assert p.logprobs == 0 and p.prompt_logprobs == 20
    assert p.seed == -1


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_numpy_scalars_accepted() -> None:
    import numpy as np

    p = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5))
    assert type(p.max_tokens) is int and p.max_tokens == 8
    assert type(p.temperature) is float and p.temperature == 0.5


def test_clone_validates_and_does_not_share_state() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[5], logit_bias={1: 1.0})
    q = p.clone(temperature=0, top_k=-1)
    assert q.greedy and q.top_k == 0
    assert q.stop == ["x"] and q.stop_token_ids == [5] and q.logit_bias == {1: 1.0}
    assert q.stop is not p.stop
    assert q.stop_token_ids is not p.stop_token_ids
    assert q.logit_bias is not p.logit_bias
    assert p.temperature == 1.0  # the original is untouched

    with pytest.raises(SamplingParamsError) as excinfo:
        p.clone(top_p=2.0)
    assert excinfo.value.param == "top_p"
    with pytest.raises(TypeError, match="nonsense"):
        p.clone(nonsense=1)
