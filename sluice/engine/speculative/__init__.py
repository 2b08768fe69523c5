"""Speculative decoding, the engine's side: proposers of draft tokens and the
speculator that decides, each step, which requests get how many (verification is the
runner's: sluice/runner/spec_verify.py)."""

from sluice.engine.speculative.ngram import NgramProposer
from sluice.engine.speculative.proposer import Proposer
from sluice.engine.speculative.speculator import (
    Speculator,
    best_num_drafts,
    plan_drafts,
)
from sluice.engine.speculative.step_costs import StepCosts
from sluice.engine.speculative.suffix import SuffixProposer

__all__ = [
    "NgramProposer",
    "Proposer",
    "Speculator",
    "StepCosts",
    "SuffixProposer",
    "best_num_drafts",
    "plan_drafts",
]
