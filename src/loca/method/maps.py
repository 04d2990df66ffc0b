"""The calibrated feedback maps ``F_l: e -> g_l`` of every block, as low-rank factors: what Stage I
makes and, through :class:`loca.method.credit.Credit`'s members, what turns head errors into block
targets in Stage II."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..core import stacked
from ..core.ridge import FeedbackFactors, gate_mask
from ..data.batching import ROLES
from ..models.parts import ModelParts, fingerprint
from .artefacts import MAPS_CONFIG, MAPS_WEIGHTS, read_maps, write_maps

GATES = {"none": 1, "role": len(ROLES)}  # feedback_gate -> number of maps per block


@dataclass
class FeedbackMaps:
    """The calibrated maps of every block, as factors, with the checkpoint they belong to."""

    factors: list[FeedbackFactors]
    fingerprint: dict
    meta: dict = field(default_factory=dict)

    @property
    def gate(self) -> str:
        """How a position picks its map: 'none' (one map) or 'role' (one per :data:`ROLES`)."""
        return self.meta.get("feedback_gate", "none")

    @property
    def gates(self) -> int:
        return GATES[self.gate]

    @property
    def width(self) -> int:
        """Columns of the side-by-side factors: gates × rank (the Stage II statistics' k)."""
        return self.factors[0].v.shape[1]

    @property
    def rank(self) -> int:
        """Rank k of each map."""
        return self.width // self.gates

    def mask(self, roles: Tensor, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """N × width: the columns of each position's map (None for one map)."""
        return gate_mask(roles, self.gates, self.rank, dtype)

    def sigma(self, layer: int) -> Tensor:
        """Singular values of block ``layer``'s map (the column norms of U_k Σ_k)."""
        return self.factors[layer].us.norm(dim=0)

    def to_blocks(self, parts: ModelParts) -> FeedbackMaps:
        """Copy each block's factors to that block's device, the blocks of a device as slices of one
        buffer per factor (so a Stage II pass takes all of them side by side without a copy)."""
        devices = parts.block_devices()
        us = stacked.pack([f.us for f in self.factors], devices, self.factors[0].us.dtype)
        v = stacked.pack([f.v for f in self.factors], devices, self.factors[0].v.dtype, dim=1)  # side by side
        factors = [FeedbackFactors(*p) for p in zip(us, v, strict=True)]
        return FeedbackMaps(factors, self.fingerprint, self.meta)

    @property
    def num_blocks(self) -> int:
        return len(self.factors)

    def projection(self, layer: int) -> Tensor:
        """``V_k`` of block ``layer`` (d × width): the head error's columns (the credit's input)."""
        return self.factors[layer].v

    def lift(self, layer: int) -> Tensor:
        """``U_k Σ_k`` of block ``layer`` (d × width)."""
        return self.factors[layer].us

    def save_pretrained(self, directory: str | Path) -> Path:
        tensors = {}
        for i, f in enumerate(self.factors):
            tensors[f"us.{i}"] = f.us.detach().cpu().contiguous()
            tensors[f"v.{i}"] = f.v.detach().cpu().contiguous()
        return write_maps(directory, tensors, {"fingerprint": self.fingerprint, **self.meta})

    @classmethod
    def from_pretrained(cls, directory: str | Path, parts: ModelParts | None = None) -> FeedbackMaps:
        """Load maps; with ``parts``, refuse maps calibrated on another checkpoint."""
        directory = Path(directory)
        tensors, cfg = read_maps(directory, fingerprint(parts) if parts is not None else None)
        n = cfg["fingerprint"].get("num_blocks")
        try:
            factors = [FeedbackFactors(tensors[f"us.{i}"], tensors[f"v.{i}"]) for i in range(n)]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{directory / MAPS_WEIGHTS}: does not hold {n} blocks' maps ({exc})") from None
        shapes = {(f.us.shape, f.v.shape) for f in factors}
        if len(shapes) != 1 or factors[0].us.shape != factors[0].v.shape or factors[0].us.ndim != 2:
            raise ValueError(f"{directory / MAPS_WEIGHTS}: inconsistent map shapes")
        if not all(torch.isfinite(f.us).all() and torch.isfinite(f.v).all() for f in factors):
            raise ValueError(f"{directory / MAPS_WEIGHTS}: holds NaN or Inf values")
        meta = {k: v for k, v in cfg.items() if k not in ("format", "version", "fingerprint")}
        gate = meta.get("feedback_gate", "none")
        if gate not in GATES or factors[0].v.shape[1] % GATES[gate]:
            raise ValueError(
                f"{directory / MAPS_CONFIG}: feedback_gate {gate!r} does not match the maps' shape"
            )
        maps = cls(factors, cfg["fingerprint"], meta)
        return maps.to_blocks(parts) if parts is not None else maps
