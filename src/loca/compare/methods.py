"""One method on one prepared task split: fit it, leave the model in its selected state, and
hand back the result and how to return the model to its frozen state.

Every method sees the same :class:`CellData`: the same examples, encoded once, batched by one
path (:func:`loca.data.batching.make_batches`), the same held-out batches for selection.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..baselines.common import HeldoutSelector, MethodResult
from ..config import LocaConfig
from ..data import Batch, Encoded, Splits, Task
from ..method import run as method_run
from ..method.calibrate import Calibrator
from ..models.parts import ModelParts

METHODS = (
    "frozen", "lora", "lora-paper", "loca", "loca-abs", "adapter-bp", "adapter-bp-predict", "adapter-mezo",
    "mezo",
)  # fmt: skip
CEILINGS = ("adapter-bp-predict", "adapter-bp")  # R_ceiling's reference, the first present


@dataclass
class CellData:
    """A task's splits on one seed, encoded and batched for every method."""

    parts: ModelParts
    tokenizer: object
    task: Task
    splits: Splits
    train_items: list[Encoded]
    heldout_items: list[Encoded]
    train: list[Batch]  # LoCA's passes (batch_size sequences each)
    heldout: list[Batch]  # held-out selection, every method
    minibatches: list[Batch]  # LoRA / MeZO optimisation steps (train_batch_size sequences each)
    pad_id: int
    seed: int
    pipeline: object  # the loca.pipeline.Pipeline that drew and encoded the data (evaluation)


Outcome = tuple[MethodResult, Callable[[], None]]


def run_frozen(cell: CellData) -> Outcome:
    """The unmodified model: its held-out CE is every method's starting point."""
    sel = HeldoutSelector(cell.parts, cell.heldout, snapshot=lambda: None, restore=lambda s: None)
    sel.evaluate(None, 0)
    return sel.result("frozen", "none"), lambda: None


def run_loca(cell: CellData, cfg: LocaConfig, method: str = "loca") -> Outcome:
    """Calibration (one probe backward pass) then the forward-only fit, with its η/λ selection.

    Times count from the start of calibration, so LoCA's wall time includes Stage I."""
    start = time.perf_counter()
    calibrator = Calibrator(cell.parts, cell.train_items, cell.heldout_items, cfg, cell.pad_id)
    run = method_run.run_loca(cell.parts, calibrator, cell.train, cell.heldout, cfg, progress=False)
    maps, res = run.maps, run.result
    calib_s = time.perf_counter() - start - (run.wall_time_s - run.calibration_s)
    rows = [r for r in res.history if "diagnostic" not in r and r["heldout_ce"] is not None]
    history = [
        {
            "candidate": None if r["eta"] is None else {"eta": r["eta"], "lam_rel": r["lam_rel"]},
            "step": r["iteration"],
            "heldout_ce": r["heldout_ce"],
            "elapsed_s": calib_s + r["elapsed_s"],
            "train_ce": r["train_ce"],
            "b_norm": r["b_norm"],
        }
        for r in rows
    ]
    best = min(history, key=lambda h: h["heldout_ce"])  # the first row at the lowest CE: fit's pick
    result = MethodResult(
        method=method,
        frozen_heldout_ce=res.frozen_heldout_ce,
        heldout_ce=res.heldout_ce,
        selected={"eta": res.eta, "lam_rel": res.lam_rel} if res.improved else {},
        best_step=res.best_iteration,
        step_unit="iteration",
        improved=res.improved,
        time_to_best_s=best["elapsed_s"] if res.improved else calib_s,
        wall_time_s=time.perf_counter() - start,
        history=history,
        extra={
            "calibration_time_s": calib_s,
            "alignment": maps.meta.get("alignment", {}),
            "stop_reasons": res.stop_reasons,
            "b_norm": res.adapters.norm(),
            "step_scale": cfg.step_scale,
            "recalibrations": res.recalibrations,
            "recalibration_time_s": res.recalibration_time_s,
            "alignment_during_fit": [
                {"iteration": r["iteration"], "median": r["median"], "per_block": r["alignment"]}
                for r in res.history if r.get("diagnostic") == "heldout_alignment"
            ],
        },
    )
    return result, res.adapters.detach


def run_lora(cell: CellData, settings, method: str = "lora") -> Outcome:
    """LoRA; ``lora-paper`` is the same fit with the paper's settings, kept at its last iterate."""
    from ..baselines.lora import fit_lora

    run = fit_lora(cell.parts, cell.minibatches, cell.heldout, settings, progress=False)
    return replace(run.result, method=method), run.unload


def run_adapter_bp(cell: CellData, settings, method: str = "adapter-bp") -> Outcome:
    """LoCA's adapters (its A for this seed; a principal A from LoCA's own batches) with B trained
    by backpropagation on the minibatches."""
    from ..baselines.adapter_bp import fit_adapter_bp
    from ..method.a_init import principal_a
    from ..method.adapters import ResidualAdapters

    a = None
    if settings.a_init == "principal":
        a = principal_a(cell.parts, cell.train, settings.rank, settings.seed)
    adapters = ResidualAdapters(cell.parts, rank=settings.rank, seed=settings.seed, a=a)
    try:
        run = fit_adapter_bp(cell.parts, cell.minibatches, cell.heldout, settings, adapters=adapters,
                             progress=False)  # fmt: skip
    except BaseException:
        adapters.detach()
        raise
    return replace(run.result, method=method), run.restore


def run_adapter_mezo(cell: CellData, settings) -> Outcome:
    from ..baselines.mezo import fit_adapter_mezo

    run = fit_adapter_mezo(cell.parts, cell.minibatches, cell.heldout, settings, progress=False)
    return run.result, run.restore


def run_mezo(cell: CellData, settings) -> Outcome:
    from ..baselines.mezo import fit_mezo

    run = fit_mezo(cell.parts, cell.minibatches, cell.heldout, settings, progress=False)
    return run.result, run.restore
