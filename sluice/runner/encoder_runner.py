"""Runs an embedding model's steps: whole inputs through the encoder, then the pooler.

The engine schedules embedding requests like any other (sluice/engine/scheduler.py
grants an encoder's input whole: its attention looks both ways, so a chunk could not
be computed before the rest); this runner is what executes them. An encoder keeps no
KV cache: its block ids are only the scheduler's accounting, and it holds no pool.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.config import ModelConfig
from sluice.core.request import Request
from sluice.models.pooler import Pooler
from sluice.runner.model_runner import ModelOutput


class EncoderRunner:
    """An encoder and its pooler over packed steps; built by runner/factory.py."""

    def __init__(
        self,
        *,
        config: ModelConfig,
        model: nn.Module,  # (token ids [T], input lengths) -> hidden states [T, hidden]
        pooler: Pooler,
        device: torch.device,
    ) -> None:
        self.config = config
        self.model = model
        self.pooler = pooler
        self.device = device

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> ModelOutput:
        """Each scheduled request's whole prompt in one pass; its vector in `pooled`."""
        for req, n in scheduled:
            assert req.num_computed_tokens == 0 and n == req.num_prompt_tokens, (
                "an encoder computes an input whole"
            )
        # Shortest first: attention pads inputs of similar length together.
        scheduled = sorted(scheduled, key=lambda rn: rn[1])
        ids = [t for req, _ in scheduled for t in req.prompt_token_ids]
        lens = [n for _, n in scheduled]
        hidden = self.model(torch.tensor(ids, device=self.device), lens)
        vectors = self.pooler(hidden, lens).cpu()
        pooled = {req.request_id: vectors[i] for i, (req, _) in enumerate(scheduled)}
        empty = torch.empty(0, self.config.vocab_size)
        return ModelOutput(empty, [], [], {}, pooled=pooled)

    def weight_bytes(self) -> int:
        """Bytes of the encoder's and the pooler's weights as held."""
        params = [*self.model.parameters(), *self.pooler.parameters()]
        return sum(p.numel() * p.element_size() for p in params)

    def expert_tokens(self) -> list[list[int]]:
        return []

    def copy_blocks(self, copies: list[tuple[int, int]], group: int = 0) -> None:
        assert not copies, "an encoder shares no blocks (no prefix cache)"
