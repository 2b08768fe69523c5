"""Tokenizer: a `tokenizers.Tokenizer` plus what generation needs (BOS, end ids, chat template).

Built either from a Hugging Face directory (tokenizer.json) or from the `tokenizer.ggml.*`
metadata of a GGUF file, in which case the tokenizers pipeline is assembled to reproduce
llama.cpp's tokenization (same pre-tokenizer regexes, same special-token handling).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
_PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"],
    **{k: [_GPT2_RE] for k in ("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion")},
    **{
        k: [r"\p{N}", _GPT2_RE]
        for k in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
    },
    **{
        k: [_LLAMA3_RE]
        for k in (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "dbrx",
            "smaug-bpe",
        )
    },
    **{k: [_QWEN2_RE] for k in ("qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan", "megrez")},
}
# llama.cpp looks up whole pre-tokens in the vocabulary before merging for these.
_IGNORE_MERGES = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
}
# Tokens that end a turn, by text: llama.cpp's end-of-generation list (llama-vocab.cpp).
_EOG_TEXTS = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
}
_SPM_SPACE = "\u2581"


class _GenerationTag(jinja2.ext.Extension):
    """HF templates may mark assistant text with {% generation %}...{% endgeneration %}; for
    rendering it is a no-op block."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's API is a class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's builtin tojson HTML-escapes; HF's does not, and templates expect HF's.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Text <-> token ids, plus the model's special ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        add_bos: bool = False,
        special_token_ids: set[int] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        # Primary eos first (it is what templates call eos_token), the rest deduplicated.
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.add_bos = add_bos
        if special_token_ids is None:
            special_token_ids = {
                i for i, t in backend.get_added_tokens_decoder().items() if t.special
            }
        self.special_token_ids: set[int] = set(special_token_ids)
        self.vocab_size: int = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
        self._template: jinja2.Template | None = None

    # -- basic API -------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The backend's post-processor is bypassed: BOS is added here, only if the model wants it,
        # so GGUF- and HF-built tokenizers behave the same.
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        token = self._backend.id_to_token(i)
        if token is None:
            raise IndexError(f"token id {i} is out of range (vocab size {self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def _token_text(self, i: int | None) -> str:
        return "" if i is None else self._backend.decode([i], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers does."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (it is probably a base model); "
                "pass a plain prompt instead of chat messages"
            )
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[jinja2.ext.loopcontrols, _GenerationTag],
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        variables: dict[str, Any] = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
        }
        variables.update(kwargs)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    # -- persistence (the warm-start cache) --------------------------------------------------

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(self._backend.to_str())
        meta = {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": self.eos_token_ids,
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
            "special_token_ids": sorted(self.special_token_ids),
            "vocab_size": self.vocab_size,
        }
        (directory / "sluice_tokenizer.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        meta = json.loads((directory / "sluice_tokenizer.json").read_text())
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        return cls(
            backend,
            bos_token_id=meta["bos_token_id"],
            eos_token_ids=meta["eos_token_ids"],
            chat_template=meta["chat_template"],
            add_bos=meta["add_bos"],
            special_token_ids=set(meta["special_token_ids"]),
            vocab_size=meta["vocab_size"],
        )

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> Tokenizer:
        """Build from a GGUF file's `tokenizer.ggml.*` metadata (a path or a GGUFReader)."""
        from .gguf_loader import GGUFMetadata

        meta = GGUFMetadata.of(reader_or_path)
        return _tokenizer_from_gguf_metadata(meta)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model directory (tokenizer.json and friends)."""
        directory = Path(path)
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        config = _read_json(directory / "tokenizer_config.json")
        gen_config = _read_json(directory / "generation_config.json")
        model_config = _read_json(directory / "config.json")

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        bos = token_id(config.get("bos_token"))
        if bos is None and isinstance(model_config.get("bos_token_id"), int):
            bos = model_config["bos_token_id"]
        eos_ids: list[int] = []
        eos = token_id(config.get("eos_token"))
        if eos is not None:
            eos_ids.append(eos)
        for source in (gen_config, model_config):
            value = source.get("eos_token_id")
            eos_ids.extend([value] if isinstance(value, int) else list(value or []))
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        eos_ids.extend(sorted(i for i in special if backend.id_to_token(i) in _EOG_TEXTS))

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            # No flag: the tokenizer.json post-processor says whether it prepends BOS.
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(probe) and probe[0] == bos

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            chat_template=template,
            add_bos=add_bos,
            special_token_ids=special,
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


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


def _tokenizer_from_gguf_metadata(meta: Any) -> Tokenizer:
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
    eog.extend(i for i, t in enumerate(tokens) if t in _EOG_TEXTS)
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


def _sentencepiece_bpe(meta: Any, tokens: list[str], types: list[int]) -> dict[str, Any]:
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
    if gemma or scores is None:
        # Gemma's scores do not follow its merge order; its file order does.
        rank = {tok: float(-i) for tok, i in vocab.items()}
    else:
        rank = {tok: float(scores[i]) for tok, i in vocab.items()}
    mergeable = {tok: i for tok, i in vocab.items() if types[i] in (_NORMAL, _USER_DEFINED)}
    candidates: list[tuple[float, int, str, str]] = []
    for tok, i in mergeable.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in mergeable and right in mergeable:
                candidates.append((-rank[tok], i, left, right))
    candidates.sort()
    merges = [[left, right] for _, _, left, right in candidates]

    added = [
        _added_token(i, tok, special=typ in (_CONTROL, _UNKNOWN))
        for i, (tok, typ) in enumerate(zip(tokens, types, strict=True))
        if typ in (_CONTROL, _USER_DEFINED, _UNKNOWN)
    ]
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
    add_prefix = (not gemma) if add_prefix is None else bool(add_prefix)
    normalizers: list[dict[str, Any]] = []
    if add_prefix:
        normalizers.append({"type": "Prepend", "prepend": _SPM_SPACE})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": _SPM_SPACE})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": _SPM_SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
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
