"""Constrained decoding: constraints compiled to grammar matchers (`compiler`), and the
engine's per-step side, masks and forced tokens (`constraints`)."""

from sluice.structured.compiler import GrammarCompiler, grammar_text
from sluice.structured.constraints import (
    ConstraintMasks,
    advance,
    forced_tokens,
    unpack_bitmask,
    valid_drafts,
)

__all__ = [
    "ConstraintMasks",
    "GrammarCompiler",
    "advance",
    "forced_tokens",
    "grammar_text",
    "unpack_bitmask",
    "valid_drafts",
]
