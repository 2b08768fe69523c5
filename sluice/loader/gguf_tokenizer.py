"""A `Tokenizer` from the `tokenizer.ggml.*` metadata of a GGUF file.

The tokenizers pipeline is assembled to reproduce llama.cpp's tokenization (same
pre-tokenizer regexes, same special-token handling).
"""

from __future__ import annotations

import json
import os
from typing import Any

import tokenizers

from .gguf_metadata import GGUFMetadata
from .tokenizer import EOG_TEXTS, Tokenizer

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes from llama.cpp's llama-vocab.cpp, keyed by `tokenizer.ggml.pre`. Each
# entry is a list: llama.cpp applies them one after the other, each splitting the pieces of the
# previous one, which is what a Sequence of "isolated" Splits does.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama-3-style pre-tokenizers for which llama.cpp looks up whole pre-tokens in the
# vocabulary before merging (see _IGNORE_MERGES); dbrx and smaug-bpe split the same way
# but merge as usual.
_LLAMA3_IGNORING_MERGES = (
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
)
_PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"],
    **{k: [_GPT2_RE] for k in ("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion")},
    **{
        k: [r"\p{N}", _GPT2_RE]
        for k in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
    },
    **{k: [_LLAMA3_RE] for k in (*_LLAMA3_IGNORING_MERGES, "dbrx", "smaug-bpe")},
    **{k: [_QWEN2_RE] for k in ("qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan", "megrez")},
}
# llama.cpp looks up whole pre-tokens in the vocabulary before merging for these.
_IGNORE_MERGES = frozenset(_LLAMA3_IGNORING_MERGES)
_SPM_SPACE = "\u2581"


def _added_token(i: int, content: str, special: bool) -> dict[str, Any]:
    return {
        "id": i,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def tokenizer_from_gguf(source: GGUFMetadata | str | os.PathLike[str]) -> Tokenizer:
    """Build from a GGUF file's `tokenizer.ggml.*` metadata (a path, or the metadata
    `gguf_loader` already opened)."""
    meta = GGUFMetadata.of(source)
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre") or "default"

    if model == "gpt2":
        spec = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [], pre)
        default_add_bos = pre in _IGNORE_MERGES  # llama.cpp: llama3-style vocabs want BOS
    elif model == "llama":
        spec = _sentencepiece_bpe(meta, tokens, types)
        default_add_bos = True
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eog: list[int] = [] if eos is None else [int(eos)]
    for key in (
        "eot_token_id",
        "eom_token_id",
        "fim_pad_token_id",
        "fim_rep_token_id",
        "fim_sep_token_id",
    ):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < len(tokens):
            eog.append(int(value))
    eog.extend(i for i, t in enumerate(tokens) if t in EOG_TEXTS)
    special = {i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)}
    return Tokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eog,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos=default_add_bos if add_bos is None else bool(add_bos),
        special_token_ids=special,
        vocab_size=len(tokens),
    )


def _byte_level_bpe(
    tokens: list[str], types: list[int], merges: list[str], pre: str
) -> dict[str, Any]:
    """tokenizer.json for a GPT-2 style byte-level BPE vocabulary."""
    regexes = _PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            f"{', '.join(sorted(_PRE_TOKENIZER_REGEXES))}"
        )
    vocab: dict[str, int] = {}
    added: list[dict[str, Any]] = []
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        vocab.setdefault(tok, i)
        if typ in (_CONTROL, _USER_DEFINED):
            # llama.cpp matches control and user-defined tokens by their literal text, before
            # pre-tokenization; an added token with a fixed id does the same here.
            added.append(_added_token(i, tok, special=typ == _CONTROL))
    pre_tokenizers: list[dict[str, Any]] = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in regexes
    ]
    pre_tokenizers.append(
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre in _IGNORE_MERGES,
            "vocab": vocab,
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def _sentencepiece_bpe(meta: GGUFMetadata, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """tokenizer.json approximating llama.cpp's SentencePiece ("llama") tokenizer with a BPE
    model: merges are derived from the vocabulary, best-scoring result first, and unknown
    characters fall back to <0xNN> byte tokens."""
    scores: list[float] | None = meta.get("tokenizer.ggml.scores")
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    # Gemma stores multi-space tokens with real spaces, while text is normalized to U+2581.
    spelled = [t.replace(" ", _SPM_SPACE) if t and not t.strip(" ") else t for t in tokens]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(spelled):
        vocab.setdefault(tok, i)
    merges = _spm_merges(vocab, types, _spm_merge_ranks(vocab, scores, gemma))
    added = [
        _added_token(i, tok, special=typ in (_CONTROL, _UNKNOWN))
        for i, (tok, typ) in enumerate(zip(tokens, types, strict=True))
        if typ in (_CONTROL, _USER_DEFINED, _UNKNOWN)
    ]
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
    add_prefix = (not gemma) if add_prefix is None else bool(add_prefix)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": _spm_normalizer(add_prefix),
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": _spm_decoder(add_prefix),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None if unk is None else tokens[int(unk)],
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _spm_merge_ranks(
    vocab: dict[str, int], scores: list[float] | None, gemma: bool
) -> dict[str, float]:
    """Each token's rank as a merge result, higher merging first: its score, else its
    place in the file."""
    if gemma or scores is None:
        # Gemma's scores do not follow its merge order; its file order does.
        return {tok: float(-i) for tok, i in vocab.items()}
    return {tok: float(scores[i]) for tok, i in vocab.items()}


def _spm_merges(vocab: dict[str, int], types: list[int], rank: dict[str, float]) -> list[list[str]]:
    """Every way of making a normal or user-defined token from two others, best-ranked
    result first (ties: by token id, then shorter left part)."""
    mergeable = {tok: i for tok, i in vocab.items() if types[i] in (_NORMAL, _USER_DEFINED)}
    candidates: list[tuple[float, int, str, str]] = []
    for tok, i in mergeable.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in mergeable and right in mergeable:
                candidates.append((-rank[tok], i, left, right))
    candidates.sort()
    return [[left, right] for _, _, left, right in candidates]


def _spm_normalizer(add_prefix: bool) -> dict[str, Any]:
    """SentencePiece's normalization: spaces as U+2581, one prepended if add_prefix."""
    normalizers: list[dict[str, Any]] = []
    if add_prefix:
        normalizers.append({"type": "Prepend", "prepend": _SPM_SPACE})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": _SPM_SPACE})
    return {"type": "Sequence", "normalizers": normalizers}


def _spm_decoder(add_prefix: bool) -> dict[str, Any]:
    """The normalization undone: U+2581 back to spaces, <0xNN> byte tokens back to
    bytes, and the prepended space dropped."""
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": _SPM_SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "decoders": decoders}
