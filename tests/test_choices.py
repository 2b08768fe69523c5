"""Each list of choices is written once (sluice.core.choices); the rest derives from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sluice.architectures import REGISTRY
from sluice.config import EngineConfig, ModelConfig, resolve_quantization
from sluice.core.choices import (
    ARCHITECTURES,
    DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    WEIGHT_QUANTIZATIONS,
)
from sluice.core.errors import ConfigError
from sluice.models import ENCODER_CLASSES, MODEL_CLASSES, encoder_class, model_class

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("field", "choices"),
    [
        ("dtype", DTYPES),
        ("quantization", QUANTIZATIONS),
        ("scheduling_policy", SCHEDULING_POLICIES),
    ],
)
def test_config_accepts_exactly_the_choices(field: str, choices: tuple[str, ...]) -> None:
    for choice in choices:
        assert getattr(EngineConfig(**{field: choice}), field) == choice
    with pytest.raises(ConfigError) as err:
        EngineConfig(**{field: "nope"})
    assert err.value.param == field
    assert str(err.value) == f"{field} must be one of {', '.join(choices)}; got 'nope'"


def test_device() -> None:
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert EngineConfig(device=device).device == device
    for device in ("gpu", "cuda:", "cpu:0", ""):
        with pytest.raises(ConfigError, match="device must be one of auto, cpu, cuda or cuda:N"):
            EngineConfig(device=device)


def test_config_errors_are_value_errors_naming_the_option() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive integer") as err:
        EngineConfig(block_size=0)
    assert isinstance(err.value, ConfigError) and err.value.param == "block_size"


def test_auto_quantization_resolves_to_a_weight_method() -> None:
    import torch

    cpu = torch.device("cpu")
    for quantized_file in (False, True):
        got = resolve_quantization("auto", cpu, torch.bfloat16, quantized_file)
        assert got in WEIGHT_QUANTIZATIONS
    with pytest.raises(ConfigError, match="quantization must be one of"):
        resolve_quantization("int3", cpu, torch.float32, False)
    with pytest.raises(ConfigError, match="needs a GGUF file with quantized weights"):
        resolve_quantization("gguf", cpu, torch.float32, False)


def test_architectures_have_a_model_and_loaders_map_into_them() -> None:
    # The loaders and the model registry all read sluice.architectures.REGISTRY.
    assert tuple(REGISTRY) == ARCHITECTURES
    for arch in ARCHITECTURES:
        config = ModelConfig(arch, 10, 8, 16, 1, 2, 2, 4)
        spec = REGISTRY[arch]
        if spec.encoder:  # embedding encoders: safetensors only
            assert encoder_class(config) is ENCODER_CLASSES[spec.model] and spec.hf_classes
            continue
        assert model_class(config) is MODEL_CLASSES[spec.model]
        assert spec.gguf_names and spec.hf_classes
    with pytest.raises(ValueError, match="sluice supports: llama, qwen2, qwen3"):
        ModelConfig("gpt2", 10, 8, 16, 1, 2, 2, 4)


def test_readme_lists_every_choice() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    for option, choices in [
        ("dtype", DTYPES),
        ("scheduling_policy", SCHEDULING_POLICIES),
        ("quantization", QUANTIZATIONS),
        ("speculative_method", SPECULATIVE_METHODS),
    ]:
        # The option's description: from its name to the next option's backquoted name.
        m = re.search(rf"`{option}` \((.*?)\)(,|\.)", readme)
        assert m, f"README.md does not describe `{option}`"
        for choice in choices:
            assert re.search(rf"\b{choice}\b", m.group(1)), f"README.md: {option} misses {choice}"
