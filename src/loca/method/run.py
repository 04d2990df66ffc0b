"""One LoCA run: Stage I (the maps, with calibration rounds if configured) then the forward-only
fit, reporting to a writer as it goes. :class:`loca.pipeline.Pipeline`, ``loca compare``,
``loca bench`` and calibration rounds all run LoCA through here."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from ..config import LocaConfig
from ..data.batching import Batch
from ..infra import distributed
from ..models.parts import ModelParts
from .adapters import ResidualAdapters
from .calibrate import Calibrator
from .fit import FitResult, check_rank, fit
from .maps import FeedbackMaps
from .state import FitState

log = logging.getLogger("loca")


class RunWriter:
    """What a run reports as it goes; this base writes nothing and logs the calibration summary.
    A run folder (:class:`loca.run_folder.RunFolder`) overrides it; data-parallel runs hand one
    only to rank 0."""

    def maps(self, maps: FeedbackMaps, calibrated: bool) -> None:
        """The maps the fit will use (``calibrated``: made by this run, not loaded)."""
        align = maps.meta.get("alignment", {})
        if align:
            log.info(
                f"calibration: alignment probe {_range(align['probe'])}, held-out "
                f"{_range(align.get('heldout', []))}, random map {_range(align['random'])}"
            )

    def iteration(self, row: dict) -> None:
        """A history row (one candidate's step, or a diagnostic)."""

    def improved(self, adapters: ResidualAdapters, row: dict) -> None:
        """A new best snapshot: ``adapters`` hold it, ``row`` is its history row."""

    def checkpoint(self, state: FitState) -> None:
        """The fit's state after a completed iteration."""


@dataclass
class LocaRun:
    """What :func:`run_loca` returns: the maps, the fit (adapters at the selected snapshot,
    attached), and the time spent in Stage I and in all."""

    maps: FeedbackMaps
    result: FitResult
    calibration_s: float
    wall_time_s: float


def calibrate_maps(
    calibrator: Calibrator,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    cfg: LocaConfig,
    meta: dict | None = None,
) -> FeedbackMaps:
    """Stage I as configured: one probe at the model's current state, or with
    ``calibration_rounds`` R > 1, R probes pooled: after each, a short forward-only fit
    (``calibration_round_iters`` steps from B = 0 with the maps so far) moves the adapters to where
    the next probe is taken, so the maps also fit the errors that remain once the first steps have
    been taken. The adapters are removed again: Stage II starts from B = 0. ``meta`` is recorded
    in the maps' metadata, with the calibration time."""
    check_same_data(train, heldout, meta)
    t0 = time.perf_counter()
    rounds = cfg.calibration_rounds
    if rounds > 1:
        check_rank(cfg.rank, calibrator.parts)  # the rounds' short fits
    if rounds == 1:
        maps = calibrator.refit()
    else:
        short = replace(
            cfg,
            max_iters=cfg.calibration_round_iters,
            recalibrate_every=0,
            alignment_every=0,
            calibration_rounds=1,
        )
        pool: list = []
        maps = calibrator.refit(pool)
        for _ in range(rounds - 1):
            with torch.no_grad():
                res = fit(calibrator.parts, maps, train, heldout, short, progress=False)
            try:
                maps = calibrator.refit(pool)  # at the short fit's selected adapters
            finally:
                res.adapters.detach()
        maps.meta["calibration_rounds"] = rounds
    maps.meta.update({**(meta or {}), "calibration_time_s": time.perf_counter() - t0})
    return maps


def run_loca(
    parts: ModelParts,
    calibrator: Calibrator,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    cfg: LocaConfig,
    *,
    maps: FeedbackMaps | None = None,
    meta: dict | None = None,
    resume: FitState | None = None,
    writer: RunWriter | None = None,
    progress: bool = True,
) -> LocaRun:
    """Calibrate (unless ``maps`` are given; ``meta`` goes into new maps' metadata), then fit.
    A forward-only fit (no re-calibration, no alignment diagnostic) runs with autograd disabled.
    ``resume`` continues a fit from its saved state; ``writer`` receives the maps, every history
    row, every new best and every checkpoint."""
    check_rank(cfg.rank, parts)  # before calibrating
    writer = writer or RunWriter()
    start = time.perf_counter()
    calibrated = maps is None
    if calibrated:
        maps = calibrate_maps(calibrator, train, heldout, cfg, meta)  # checks the data first
    else:
        check_same_data(train, heldout, meta)
    calibration_s = time.perf_counter() - start
    writer.maps(maps, calibrated)
    forward_only = not (cfg.recalibrate_every or cfg.alignment_every)
    with torch.no_grad() if forward_only else nullcontext():
        result = fit(
            parts,
            maps,
            train,
            heldout,
            cfg,
            calibrator=None if forward_only else calibrator,
            on_iteration=writer.iteration,
            on_improve=writer.improved,
            on_checkpoint=writer.checkpoint,
            resume=resume,
            progress=progress,
        )
    return LocaRun(maps, result, calibration_s, time.perf_counter() - start)


def check_same_data(train: Sequence[Batch], heldout: Sequence[Batch], meta: dict | None = None) -> None:
    """Data parallel: refuse, on every rank, to start when the ranks' training or held-out
    sequences, or the test examples their split record names, differ (a hash is exchanged)."""
    if not distributed.active():
        return
    h = hashlib.sha256()
    test = ((meta or {}).get("splits") or {}).get("test") or {}
    h.update(json.dumps([test.get("ids"), test.get("indices")]).encode())
    for batches in (train, heldout):
        h.update(b"|")
        for batch in batches:
            for it in batch.items:
                h.update(repr((it.prompt, it.completion, it.has_eos)).encode())
    distributed.check_same("training, held-out or test data", h.hexdigest())


def _range(xs: list[float]) -> str:
    return f"{min(xs):+.2f}..{max(xs):+.2f}" if xs else "n/a"
