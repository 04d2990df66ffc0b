"""Stage I: one probe backward pass, then per-block rank-k feedback maps ``F_l: e -> g_l``."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from ..config import LocaConfig
from ..core.ridge import (
    FeedbackFactors,
    alignment,
    feedback_factors,
    gate_mask,
    gated_feedback_factors,
    random_factors,
)
from ..data.batching import Encoded
from ..infra.versions import versions
from ..models.parts import ModelParts, fingerprint
from .maps import GATES, FeedbackMaps
from .probe import probe_gradients, probe_roles, select_probe

_DEFAULTS = LocaConfig()  # the keyword defaults below are LocaConfig's


def _pooled(pool: list[tuple[Tensor, list[Tensor], Tensor]]) -> tuple[Tensor, list[Tensor], Tensor]:
    """Stack several probes' errors, gradients and roles, each probe's rows scaled by 1/RMS(E)."""
    scales = [1.0 / max(float(e.pow(2).mean().sqrt()), 1e-30) for e, _, _ in pool]
    errors = torch.cat([c * e for c, (e, _, _) in zip(scales, pool, strict=True)])
    blocks = len(pool[0][1])
    grads = [torch.cat([c * g[l] for c, (_, g, _) in zip(scales, pool, strict=True)]) for l in range(blocks)]
    return errors, grads, torch.cat([r for _, _, r in pool])


def fit_factors(
    errors: Tensor, grads: list[Tensor], roles: Tensor, gate: str, beta_rel: float, rank: int
) -> list[FeedbackFactors]:
    """Every block's map(s) from probe rows: one map, or one per role (``gate='role'``)."""
    if gate == "none":
        return feedback_factors(errors, grads, beta_rel, rank)
    if gate not in GATES:
        raise ValueError(f"feedback_gate must be one of {sorted(GATES)}, got {gate!r}")
    return gated_feedback_factors(errors, grads, roles, GATES[gate], beta_rel, rank)


def calibrate(
    parts: ModelParts,
    probe: Sequence[Encoded],
    heldout_probe: Sequence[Encoded] = (),
    *,
    feedback_rank: int = _DEFAULTS.feedback_rank,
    beta_rel: float = _DEFAULTS.beta_rel,
    feedback_gate: str = _DEFAULTS.feedback_gate,
    probe_synthetic: int = _DEFAULTS.probe_synthetic,
    probe_micro_batch: int = _DEFAULTS.probe_micro_batch,
    probe_checkpoint: bool = _DEFAULTS.probe_checkpoint,
    probe_memory_mb: float = _DEFAULTS.probe_memory_mb,
    pad_id: int = 0,
    seed: int = 0,
    pool: list[tuple[Tensor, list[Tensor], Tensor]] | None = None,
    progress: bool = False,
) -> FeedbackMaps:
    """Fit every block's feedback map from one probe pass and report alignment diagnostics.

    ``probe`` are encoded training sequences (see :func:`select_probe`); ``heldout_probe``, if
    given, only serves the held-out alignment diagnostic. With ``pool`` (a list, possibly empty)
    the maps are fitted on this probe's errors and gradients together with those already in
    ``pool`` (earlier probes, e.g. at other adapter states), each probe weighted equally (its rows
    scaled by 1/RMS of its errors, which keeps every pair's relation ``g = F e``), and this probe's
    are appended to ``pool``. With ``probe_synthetic`` = K > 0 the probe's synthetic rows
    (:func:`synthetic_errors`) join the fit as one more such set; the diagnostics use the natural
    rows only.
    """
    if not probe:
        raise ValueError("the calibration probe is empty")
    was_training = parts.model.training
    parts.model.eval()
    try:
        errors, grads = probe_gradients(
            parts,
            probe,
            probe_micro_batch,
            pad_id,
            progress,
            probe_checkpoint,
            probe_memory_mb,
            probe_synthetic,
            seed,
        )
        roles = probe_roles(probe, pad_id).to(errors.device)
        n = roles.shape[0]  # natural rows first, then the synthetic sets (one pooled set, equal weight)
        sets = [(errors[:n], [g[:n] for g in grads], roles)]
        if probe_synthetic:
            sets.append((errors[n:], [g[n:] for g in grads], roles.repeat(probe_synthetic)))
        errors, grads = sets[0][:2]
        if pool is not None:  # a pool is always scaled (_pooled); a lone natural probe is fitted as it is
            pool.extend(sets)
            sets = pool
        fitted = sets[0] if pool is None and len(sets) == 1 else _pooled(sets)
        factors = fit_factors(*fitted, feedback_gate, beta_rel, feedback_rank)
        gates = GATES[feedback_gate]
        rank = factors[0].v.shape[1] // gates
        mask = gate_mask(roles, gates, rank)
        gen = torch.Generator().manual_seed(seed)
        d = parts.hidden_size
        random_maps = [random_factors(d, rank, gen) for _ in factors]
        diag = {
            "probe": [alignment(f, errors, g, mask) for f, g in zip(factors, grads, strict=True)],
            "random": [
                alignment(r.to_device(errors.device), errors, g)
                for r, g in zip(random_maps, grads, strict=True)
            ],
        }
        if heldout_probe:
            h_err, h_grads = probe_gradients(
                parts,
                heldout_probe,
                probe_micro_batch,
                pad_id,
                recompute=probe_checkpoint,
                memory_mb=probe_memory_mb,
            )
            h_roles = probe_roles(heldout_probe, pad_id)
            h_mask = gate_mask(h_roles, gates, rank)
            diag["heldout"] = [alignment(f, h_err, g, h_mask) for f, g in zip(factors, h_grads, strict=True)]
    finally:
        parts.model.train(was_training)
    if max(diag["probe"]) <= 0:
        warnings.warn(
            "LoCA calibration: feedback alignment is non-positive in every block; the maps carry no "
            "gradient information and Stage II will not improve the model",
            RuntimeWarning,
            stacklevel=2,
        )
    meta = {
        "probes_pooled": len(pool) if pool is not None else 1,
        "feedback_rank": rank,
        "feedback_gate": feedback_gate,
        "beta_rel": beta_rel,
        "probe_sequences": len(probe),
        "probe_positions": int(errors.shape[0]),
        "probe_synthetic": probe_synthetic,
        "heldout_probe_positions": int(h_err.shape[0]) if heldout_probe else 0,
        "alignment": diag,
        "versions": versions(),
    }
    # contiguous, as saved: the maps in memory and reloaded ones give bit-identical fits
    factors = [FeedbackFactors(f.us.cpu().contiguous(), f.v.cpu().contiguous()) for f in factors]
    maps = FeedbackMaps(factors, fingerprint(parts), meta)
    return maps.to_blocks(parts)


class Calibrator:
    """Stage I bound to one run's data and :class:`loca.config.LocaConfig`: a seeded probe of
    ``probe_positions`` predict positions from the training items, and a held-out probe a quarter
    that size (seed + 1) for the alignment diagnostic.

    :meth:`refit` fits the maps at the model's current state, adapters included, so the same
    object serves the first calibration, calibration rounds
    (:func:`loca.method.run.calibrate_maps`) and any re-calibration during a fit."""

    def __init__(
        self,
        parts: ModelParts,
        train: Sequence[Encoded],
        heldout: Sequence[Encoded],
        cfg,
        pad_id: int,
        progress: bool = False,
    ):
        self.parts, self.cfg, self.pad_id, self.progress = parts, cfg, pad_id, progress
        self.train, self.heldout = list(train), list(heldout)
        self.probe = select_probe(train, cfg.probe_positions, cfg.seed)
        self.heldout_probe = (
            select_probe(heldout, max(1, cfg.probe_positions // 4), cfg.seed + 1) if heldout else []
        )

    def refit(self, pool: list | None = None) -> FeedbackMaps:
        """One probe at the model's current state (adapters included), pooled with ``pool``."""
        cfg = self.cfg
        return calibrate(
            self.parts,
            self.probe,
            self.heldout_probe,
            feedback_rank=cfg.feedback_rank,
            beta_rel=cfg.beta_rel,
            feedback_gate=cfg.feedback_gate,
            probe_synthetic=cfg.probe_synthetic,
            probe_micro_batch=cfg.probe_micro_batch,
            probe_checkpoint=cfg.probe_checkpoint,
            probe_memory_mb=cfg.probe_memory_mb,
            pad_id=self.pad_id,
            seed=cfg.seed,
            pool=pool,
            progress=self.progress,
        )

    def heldout_alignment(self, maps: FeedbackMaps) -> list[float]:
        """Per-block alignment of ``maps`` with the true gradients on the held-out probe at the
        model's current state (one probe backward; a diagnostic)."""
        if not self.heldout_probe:
            raise ValueError("no held-out probe: the alignment diagnostic needs held-out items")
        was_training = self.parts.model.training
        self.parts.model.eval()
        try:
            err, grads = probe_gradients(
                self.parts,
                self.heldout_probe,
                self.cfg.probe_micro_batch,
                self.pad_id,
                recompute=self.cfg.probe_checkpoint,
                memory_mb=self.cfg.probe_memory_mb,
            )
        finally:
            self.parts.model.train(was_training)
        roles = probe_roles(self.heldout_probe, self.pad_id)
        pairs = zip(maps.factors, grads, strict=True)
        return [
            alignment(f, err.to(f.v.device), g.to(f.v.device), maps.mask(roles.to(f.v.device)))
            for f, g in pairs
        ]
