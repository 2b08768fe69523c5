"""Which files of a Hugging Face Hub repo a model name means.

`org/repo` is a safetensors repo: its config, tokenizer, chat template and weights.
`org/repo:QUANT` is one quantization of a GGUF repo, chosen by the tag its file names
carry (`Qwen2.5-7B-Instruct-Q4_K_M.gguf`); a quantization split over several files
(`...-Q8_0-00001-of-00003.gguf`) is the whole set. Pure functions over file listings:
hub.py fetches the listings and the files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sluice.core.errors import ModelNotFoundError

# A Hub name: an optional hf.co/ prefix, owner/repo, an optional :selector.
_HUB_NAME = re.compile(
    r"(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?"
    r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?::(?P<quant>[\w.-]{1,96}))?"
)
# The quantization tag at the end of a GGUF file's stem: Q4_K_M, IQ4_XS, Q8_0, BF16, F16,
# UD-Q4_K_XL (Unsloth's dynamic quants), MXFP4.
_QUANT_TAG = re.compile(
    r"(?:^|[-_.])((?:UD-)?(?:I?Q\d_[A-Z0-9]+(?:_[A-Z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|F16|F32))$",
    re.IGNORECASE,
)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf and Ollama's tags pick when none is named

# The files of a safetensors repo the loader reads; the rest (other formats' weights,
# README, images) is not downloaded.
SAFETENSORS_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
)


@dataclass(frozen=True)
class HubName:
    """A model named on the Hub: the repo and, for a GGUF repo, which quantization."""

    repo_id: str
    quant: str | None

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.quant}" if self.quant else self.repo_id


def parse_hub_name(name: str) -> HubName | None:
    """`name` as a Hub name, or None when it does not have that shape."""
    m = _HUB_NAME.fullmatch(name.strip())
    # A name ending in .gguf is a file's path that does not exist, not a repo.
    if m is None or ".." in m["repo"] or m["repo"].lower().endswith(".gguf"):
        return None
    return HubName(m["repo"], m["quant"])


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo as the Hub lists it (or as the cache holds it)."""

    name: str  # path inside the repo
    size: int
    sha256: str | None  # the Hub's record of an LFS file's content


@dataclass(frozen=True)
class GGUFChoice:
    """One quantization of a GGUF repo: its tag and its files, parts in order."""

    quant: str
    files: tuple[RepoFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def quant_tag(filename: str) -> str | None:
    """The quantization a GGUF file's name carries (upper case), or None."""
    stem = _SPLIT.sub("", filename.rsplit("/", 1)[-1].removesuffix(".gguf"))
    m = _QUANT_TAG.search(stem)
    return m.group(1).upper() if m else None


def _gguf_set_key(name: str) -> tuple[str, int, int]:
    """A GGUF file's set (its name without the split suffix), part number and count."""
    stem = name.removesuffix(".gguf")
    m = _SPLIT.search(stem)
    if m is None:
        return stem, 1, 1
    return stem[: m.start()], int(m[1]), int(m[2])


def gguf_choices(repo_id: str, files: list[RepoFile]) -> dict[str, GGUFChoice]:
    """The repo's GGUF quantizations by tag (a file without one by its stem); vision
    projectors (mmproj) are not models. A split set missing a part is an error."""
    sets: dict[str, dict[int, RepoFile]] = {}
    counts: dict[str, int] = {}
    for f in files:
        base = f.name.rsplit("/", 1)[-1]
        if not base.endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        key, part, count = _gguf_set_key(f.name)
        sets.setdefault(key, {})[part] = f
        counts[key] = count
    found: list[tuple[str, str, tuple[RepoFile, ...]]] = []
    for key, parts in sorted(sets.items()):
        missing = sorted(set(range(1, counts[key] + 1)) - set(parts))
        if missing:
            raise ModelNotFoundError(
                f"{repo_id}: {key}.gguf is split in {counts[key]} files and the repo "
                f"lacks part(s) {missing}"
            )
        stem = key.rsplit("/", 1)[-1]
        found.append((quant_tag(key) or stem, stem, tuple(parts[i] for i in sorted(parts))))
    tags = [tag for tag, _, _ in found]
    # Two files with one tag (an instruct and a base model in one repo): each is known by
    # its own name instead.
    choices = [
        GGUFChoice(tag if tags.count(tag) == 1 else stem, files) for tag, stem, files in found
    ]
    return {c.quant: c for c in choices}


def _listing(choices: dict[str, GGUFChoice]) -> str:
    return ", ".join(f"{q} ({c.size / 1e9:.2f} GB)" for q, c in choices.items())


def choose_gguf(name: HubName, choices: dict[str, GGUFChoice]) -> GGUFChoice:
    """The quantization `name` selects; with none named, Q4_K_M where the repo has it,
    else its smallest."""
    if not choices:
        raise ModelNotFoundError(f"{name.repo_id} has no GGUF files")
    if name.quant is None:
        return choices.get(DEFAULT_QUANT) or min(choices.values(), key=lambda c: c.size)
    wanted = name.quant.upper()
    for tag, choice in choices.items():
        if tag.upper() == wanted or tag.rsplit("/", 1)[-1].upper() == wanted:
            return choice
    raise ModelNotFoundError(
        f"{name.repo_id} has no {name.quant} GGUF; its quantizations: {_listing(choices)}"
    )


def safetensors_files(repo_id: str, files: list[RepoFile]) -> list[RepoFile]:
    """What the loader needs of a safetensors repo (top level only: subfolders are
    other components or other formats)."""
    top = [f for f in files if "/" not in f.name]
    weights = [f for f in top if f.name.endswith(".safetensors")]
    names = {f.name for f in top}
    if "config.json" not in names:
        raise ModelNotFoundError(f"{repo_id} has no config.json (and no GGUF files)")
    if not weights:
        pickles = [f.name for f in top if f.name.endswith((".bin", ".pt", ".pth"))]
        why = " (pickled .bin weights can run code when loaded: sluice does not load them)"
        raise ModelNotFoundError(f"{repo_id} has no .safetensors weights{why if pickles else ''}")
    return [f for f in top if f.name in SAFETENSORS_FILES] + weights
