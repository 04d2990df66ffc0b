"""What turns the head error into each block's local target: the credit a Stage II pass uses.

A credit mechanism gives, per block l, a projection ``V_l`` (d × k) that the pass applies to the
head error ``e`` at every predict position (``y = e V_l``, the statistics keep only ``Σ y pᵀ``),
the lift ``U_l Σ_l`` (d × k) that the ridge solve maps those k columns back with, and the column
scales ``σ_l`` used to normalise the step. A mechanism that splits positions into groups (one map
per role) masks each position's columns. :class:`loca.method.maps.FeedbackMaps` (the calibrated
feedback maps) is today's mechanism; a new one is a new class with these members, nothing in
:mod:`loca.method.stage2` changes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Credit(Protocol):
    """The interface :mod:`loca.method.stage2` reads credit through."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def width(self) -> int:
        """k: target columns per block (all groups' columns side by side)."""
        ...

    def projection(self, layer: int) -> Tensor:
        """``V_l`` (d × k), on the block's device: the head error's columns for block ``layer``."""
        ...

    def lift(self, layer: int) -> Tensor:
        """``U_l Σ_l`` (d × k): maps block ``layer``'s k target columns to its hidden size."""
        ...

    def sigma(self, layer: int) -> Tensor:
        """The k column scales of block ``layer`` (the norms of ``U_l Σ_l``'s columns)."""
        ...

    def mask(self, roles: Tensor, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """N × k: which columns each predict position contributes to (None: all of them)."""
        ...
