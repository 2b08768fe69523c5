"""Whether a draft model can draft for a target: the same tokens under the same ids.

Drafts are token ids. The target embeds them and compares them with what it samples,
so an id must mean the same text to both models, and the draft must have been trained
on the same splits of text into tokens: the same vocabulary (every token string and its
id, added tokens included) and the same merges. Both model configs must also cover
every id the tokenizer has (a model's vocabulary is often padded past it; the padding
may differ, and the draft proposes only ids both have). Anything else is a ConfigError
naming `speculative_model` at start-up, with the first difference found.
"""

from __future__ import annotations

import json
from typing import Any

from sluice.config import ModelConfig
from sluice.core.errors import ConfigError
from sluice.loader import Tokenizer


def _model_section(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizer's model (type, vocab, merges) as tokenizers serialises it."""
    section: dict[str, Any] = json.loads(tokenizer.backend.to_str())["model"]
    return section


def _merges(section: dict[str, Any]) -> list[str]:
    """Merges as "left right" strings (tokenizers writes pairs or strings by version)."""
    return [m if isinstance(m, str) else " ".join(m) for m in section.get("merges") or []]


def vocabulary_difference(target: Tokenizer, draft: Tokenizer) -> str | None:
    """The first difference between the two tokenizers' vocabularies, or None."""
    t_vocab = target.backend.get_vocab(with_added_tokens=True)
    d_vocab = draft.backend.get_vocab(with_added_tokens=True)
    if len(t_vocab) != len(d_vocab):
        return f"the target's tokenizer has {len(t_vocab)} tokens, the draft's {len(d_vocab)}"
    t_by_id = {i: s for s, i in t_vocab.items()}
    for s, i in d_vocab.items():
        t = t_by_id.get(i)
        if t != s:
            return f"token {i} is {t!r} in the target's tokenizer, {s!r} in the draft's"
    t_model, d_model = _model_section(target), _model_section(draft)
    if t_model.get("type") != d_model.get("type"):
        return f"the target's tokenizer is {t_model.get('type')}, the draft's {d_model.get('type')}"
    t_merges, d_merges = _merges(t_model), _merges(d_model)
    if len(t_merges) != len(d_merges):
        return f"the target's tokenizer has {len(t_merges)} merges, the draft's {len(d_merges)}"
    for j, (a, b) in enumerate(zip(t_merges, d_merges, strict=True)):
        if a != b:
            return f"merge {j} is {a!r} in the target's tokenizer, {b!r} in the draft's"
    return None


def check_draft_vocabulary(
    target: Tokenizer,
    target_config: ModelConfig,
    draft: Tokenizer,
    draft_config: ModelConfig,
    draft_name: str,
) -> None:
    """Raise ConfigError (speculative_model) unless the draft can draft for the target."""
    difference = vocabulary_difference(target, draft)
    if difference is not None:
        raise ConfigError(
            "speculative_model",
            f"speculative_model {draft_name!r} does not share the target model's tokenizer: "
            f"{difference}. A draft model must use the target's tokenizer (the same "
            "vocabulary and merges)",
        )
    num_tokens = target.backend.get_vocab_size(with_added_tokens=True)
    for who, config in (("the target model", target_config), ("the draft model", draft_config)):
        if config.vocab_size < num_tokens:
            raise ConfigError(
                "speculative_model",
                f"incompatible vocab sizes for speculative_model {draft_name!r}: {who} has "
                f"{config.vocab_size} ids, fewer than the tokenizer's {num_tokens} tokens "
                f"(target {target_config.vocab_size}, draft {draft_config.vocab_size})",
            )
