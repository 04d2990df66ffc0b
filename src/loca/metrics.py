"""Evaluation metrics computed from hidden states at the needed positions only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .data.batching import Batch
from .head import head_loss_and_error
from .models import ModelParts


@dataclass
class TokenCE:
    """Summed cross-entropy over completion tokens, with and without the trained EOS."""

    total: float = 0.0
    tokens: int = 0
    total_no_eos: float = 0.0
    tokens_no_eos: int = 0

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else float("nan")

    @property
    def mean_no_eos(self) -> float:
        return self.total_no_eos / self.tokens_no_eos if self.tokens_no_eos else float("nan")

    def add(self, losses: torch.Tensor, is_eos: torch.Tensor) -> None:
        losses = losses.double()
        self.total += float(losses.sum())
        self.tokens += losses.numel()
        keep = ~is_eos
        self.total_no_eos += float(losses[keep].sum())
        self.tokens_no_eos += int(keep.sum())


def position_losses(parts: ModelParts, batch: Batch) -> torch.Tensor:
    """Per-predict-position cross-entropy of the model as currently hooked (N,)."""
    b = batch.to(parts.device)
    hn = parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t)
    loss, _ = head_loss_and_error(
        hn, parts.head.weight, parts.head.bias, b.targets, parts.transform, need_error=False
    )
    return loss


@torch.inference_mode()
def completion_ce(parts: ModelParts, batches: Iterable[Batch]) -> TokenCE:
    """Mean per-token CE over the completion tokens of ``batches`` (EOS included and excluded)."""
    ce = TokenCE()
    for batch in batches:
        ce.add(position_losses(parts, batch).cpu(), batch.is_eos)
    return ce
