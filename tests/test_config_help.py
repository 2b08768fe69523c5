"""Each engine option's help text is written once, in its EngineConfig field's metadata
(config.doc); the CLI shows it, and README.md names every option."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from sluice.cli import build_parser
from sluice.config import EngineConfig
from sluice.loader.resolve import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
FIELDS = dataclasses.fields(EngineConfig)

# Every field is an option a user sets: an LLM(...) keyword and a `sluice serve` flag
# (tests/test_cli.py checks the flags). None is internal, so the README must name them
# all; a field that ever is internal belongs elsewhere than EngineConfig.
INTERNAL: frozenset[str] = frozenset()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return dict(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_option_has_help_text(field: dataclasses.Field[object]) -> None:
    assert set(field.metadata) <= {"help", "default_text"}, field.metadata
    text = field.metadata.get("help")
    assert isinstance(text, str) and text.strip(), (
        f"EngineConfig.{field.name} has no help text: give it "
        "field(default=..., metadata=doc('what a user needs to know'))"
    )
    # The CLI adds the default from the field itself: a second copy could disagree.
    assert "default:" not in text, f"EngineConfig.{field.name}: the CLI shows the default"
    if field.default is None:
        # --help would say "default: None"; say what None means (off, the model's own...).
        assert field.metadata.get("default_text"), f"EngineConfig.{field.name}: default_text"


def test_help_shows_every_option_with_its_help_choices_and_default() -> None:
    serve = _subparsers(build_parser())["serve"]
    actions = {a.dest: a for a in serve._actions}
    # argparse %-formats the help strings, and wraps lines at spaces and hyphens.
    text = "".join(serve.format_help().split())
    for f in FIELDS:
        action = actions[f.name]
        assert action.help is not None
        assert action.help.replace("%%", "%").startswith(f.metadata["help"])
        shown = f.metadata.get("default_text", f.default)
        if isinstance(shown, bool):
            shown = "on" if shown else "off"
        assert action.help.endswith(f"(default: {shown})")
        assert "".join(f.metadata["help"].split()) in text
        if action.choices:
            assert "{" + ",".join(action.choices) + "}" in text
    assert "%" in EngineConfig.__dataclass_fields__["speculative_draft_vocab_size"].metadata["help"]
    assert "37%ofthebytes" in text
    assert DEFAULT_MODEL in EngineConfig.__dataclass_fields__["model"].metadata["default_text"]


def test_generate_and_chat_show_the_same_help() -> None:
    subs = _subparsers(build_parser())
    serve = {a.dest: a.help for a in subs["serve"]._actions}
    for command in ("generate", "chat"):
        for action in subs[command]._actions:
            # Their --seed is the request's (and the engine's): _sampling_options.
            if action.dest in EngineConfig.option_names() and action.dest != "seed":
                assert action.help == serve[action.dest]


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_option_list_names_every_option() -> None:
    # The list: the paragraph that begins "Engine options are".
    readme = _readme()
    start = readme.index("Engine options are")
    paragraph = readme[start : readme.index("\n\n", start)]
    named = set(re.findall(r"`([a-z_]+)`", paragraph))
    missing = [f.name for f in FIELDS if f.name not in named and f.name not in INTERNAL]
    assert not missing, f"README.md's option list does not name {missing}"


# Not sluice's flags: the naming rule, and flags of pip and of `ray start`.
NOT_SLUICE_FLAGS = {"--kebab-case", "--no-deps", "--head", "--address"}


def test_readme_flags_are_sluice_flags() -> None:
    """A renamed or removed flag cannot linger in the README."""
    flags = {"--help"}
    parser = build_parser()
    for sub in [parser, *_subparsers(parser).values()]:
        for action in sub._actions:
            flags.update(action.option_strings)
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _readme()))
    assert used - NOT_SLUICE_FLAGS <= flags, used - NOT_SLUICE_FLAGS - flags
