"""Tokenizer: a `tokenizers.Tokenizer` plus what generation needs (BOS, end ids, chat template).

Built from a Hugging Face directory (tokenizer.json) here, or from the `tokenizer.ggml.*`
metadata of a GGUF file by `gguf_tokenizer.tokenizer_from_gguf`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import tokenizers

from sluice.core.errors import ModelFileError
from sluice.loader.chat_sandbox import compile_chat_template, environment, render_bounded

# Tokens that end a turn, by text: llama.cpp's end-of-generation list (llama-vocab.cpp).
EOG_TEXTS = {
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


def _check_text(text: str) -> None:
    """ValueError naming where `text` is not Unicode text (a lone surrogate, which JSON's
    "\\ud800" and Python's "\\ud800" can spell but no encoding can write)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text is not valid Unicode: {exc.reason} (U+{ord(text[exc.start]):04X}) "
            f"at character {exc.start}"
        ) from None


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
        post_process: bool = False,
    ) -> None:
        """post_process: special tokens come from the tokenizer's own post-processor
        (an embedding model's: BERT's [CLS] ... [SEP]), not from add_bos."""
        self._backend = backend
        self.post_process = post_process
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
        self._takes_tools: bool | None = None

    # -- basic API -------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self._encode(text, add_special_tokens)
        except TypeError:
            if isinstance(text, str):  # a lone surrogate, which the backend calls a type error
                _check_text(text)
            raise

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.post_process:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        # The backend's post-processor is bypassed: BOS is added here, only if the model wants it,
        # so GGUF- and HF-built tokenizers behave the same.
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text (special tokens added), the texts tokenized in parallel
        by the backend."""
        if not self.post_process:
            return [self.encode(t) for t in texts]
        return [list(e.ids) for e in self._backend.encode_batch(list(texts))]

    def appended_token(self) -> int | None:
        """The special token encoding puts after any text (BERT's [SEP]), or None."""
        with_specials, plain = self.encode("a"), self.encode("a", add_special_tokens=False)
        if len(with_specials) > len(plain) and with_specials[-1] != plain[-1]:
            return with_specials[-1]
        return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except OverflowError:  # the backend's ids are unsigned 32-bit
            bad = next((i for i in ids if not 0 <= i < 2**32), None)
            if bad is None:
                raise
            raise ValueError(
                f"token id {bad} is out of range (vocab size {self.vocab_size})"
            ) from None

    def id_to_token(self, i: int) -> str:
        token = self._backend.id_to_token(i)
        if token is None:
            raise IndexError(f"token id {i} is out of range (vocab size {self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """Each added token's text and id (special or not): the tokenizer never splits
        these texts, and a grammar library treats them as single special tokens, so a
        grammar that must produce one names it by id (see ``structured_output.lark_text``)."""
        return {t.content: i for i, t in self._backend.get_added_tokens_decoder().items()}

    def _token_text(self, i: int | None) -> str:
        return "" if i is None else self._backend.decode([i], skip_special_tokens=False)

    def set_chat_template(self, template: str | None) -> None:
        """Use `template` instead of the model's own (EngineConfig.chat_template)."""
        self.chat_template = template
        self._template = None
        self._takes_tools = None

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (renders tool definitions);
        one that does not would silently drop them."""
        if self._takes_tools is None:
            names = (
                jinja2.meta.find_undeclared_variables(environment().parse(self.chat_template))
                if self.chat_template is not None
                else set()
            )
            self._takes_tools = "tools" in names
        return self._takes_tools

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers does
        (keywords such as ``tools=[...]`` become template variables)."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (it is probably a base model); "
                "pass a plain prompt instead of chat messages"
            )
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        variables: dict[str, Any] = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
        }
        variables.update(kwargs)
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
        return render_bounded(self._template, variables)

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
            "post_process": self.post_process,
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
            post_process=bool(meta.get("post_process", False)),
        )

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path, post_process: bool = False) -> Tokenizer:
        """Build from a Hugging Face model directory (tokenizer.json and friends);
        post_process: an embedding model's, whose post-processor adds its special
        tokens. Padding and truncation a tokenizer.json may carry are off: inputs are
        checked and cut against the model's limit by the engine."""
        directory = Path(path)
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise ModelFileError(str(tok_file), f"not a valid tokenizer file: {exc}") from None
        backend.no_padding()
        backend.no_truncation()
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
        vocab = backend.get_vocab_size()
        for name, source in (("generation_config.json", gen_config), ("config.json", model_config)):
            eos_ids.extend(_token_ids(directory / name, source, "eos_token_id", vocab))
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        eos_ids.extend(sorted(i for i in special if backend.id_to_token(i) in EOG_TEXTS))

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            # No flag: the tokenizer.json post-processor says whether it prepends BOS.
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(probe) and probe[0] == bos

        template = _chat_template(directory / "tokenizer_config.json", config.get("chat_template"))
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
            post_process=post_process,
        )


def _read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON object file ({} where there is none)."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nested too deep
        raise ModelFileError(str(path), f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelFileError(str(path), f"not a JSON object but {type(value).__name__}")
    return value


def _token_ids(path: Path, data: dict[str, Any], key: str, vocab: int) -> list[int]:
    """A config's token id or list of them under `key` (none: []), each below `vocab`."""
    value = data.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            raise ModelFileError(
                str(path), f"{key} must be token ids of the vocabulary (0 to {vocab - 1}): {i!r}"
            )
    return ids


def _chat_template(path: Path, value: Any) -> str | None:
    """tokenizer_config.json's chat template: a string, or named templates (a list of
    {name, template}) of which the default one (else the first)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("template"), str) for t in value
    ):
        named = {t.get("name"): t["template"] for t in value}
        return named.get("default") or next(iter(named.values()), None)
    raise ModelFileError(
        str(path), "chat_template must be a string or a list of {name, template} objects"
    )
