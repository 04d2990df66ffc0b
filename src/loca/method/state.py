"""The explicit state of a forward-only fit: what :func:`loca.method.fit.fit` iterates, what a
checkpoint stores, and the pure selection rule over it.

A fit is a list of :class:`Candidate` (one per step size and ridge, or one per ridge under the
adaptive step control), the best snapshot so far (:class:`Best`, the frozen model at iteration 0
to start with) and the history rows. :func:`save_fit_state` writes a :class:`FitState` as
``fit_state.safetensors`` (A and every B) and ``fit_state.json`` (the rest), atomically;
re-calibrated maps, if any, go to ``maps/`` beside them. Every statistic is recomputed from the
restored B, so a resumed fit equals an uninterrupted one (on the CPU, bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from torch import Tensor

from ..models.parts import ModelParts
from .artefacts import FIT_STATE_CONFIG, read_fit_state, write_fit_state
from .maps import FeedbackMaps


@dataclass
class Candidate:
    """One trajectory of the fit: its step size, ridge, current B and best held-out CE."""

    eta: float
    lam_rel: float
    b: list[Tensor]
    best_ce: float
    since_best: int = 0
    stopped: str | None = None
    accepted: int = 0  # steps kept (the adaptive control's count, for re-calibration)


@dataclass(frozen=True)
class Best:
    """The selected snapshot: held-out CE, B, and the candidate and iteration that made it."""

    ce: float
    b: list[Tensor]
    eta: float | None = None
    lam_rel: float | None = None
    iteration: int = 0


def select(best: Best, ce: float, b: list[Tensor], cand: Candidate, iteration: int) -> Best:
    """The better of ``best`` and a new snapshot (held-out CE ``ce`` at adapters ``b``): strictly
    lower CE wins, so among equal ones the earliest (the frozen model first) is kept."""
    if ce < best.ce:
        return Best(ce, b, cand.eta, cand.lam_rel, iteration)
    return best


@dataclass
class FitState:
    """Everything a fit needs to continue after its last completed ``iteration``."""

    iteration: int
    frozen_ce: float
    candidates: list[Candidate]
    best: Best
    history: list[dict] = field(default_factory=list)
    a: list[Tensor] = field(default_factory=list)
    elapsed_s: float = 0.0
    recalibrations: int = 0
    recalibration_s: float = 0.0
    maps: FeedbackMaps | None = None  # set once re-calibration replaced the fit's maps

    def snapshot(self) -> FitState:
        """A copy that later iterations do not change (B tensors are replaced, never edited, so
        they are shared)."""
        return replace(self, candidates=[replace(c) for c in self.candidates], history=list(self.history))


def save_fit_state(state: FitState, directory: str | Path) -> None:
    """Write ``state`` to ``directory`` (replaced in one rename)."""
    tensors: dict[str, Tensor] = {}

    def put(prefix: str, bs: list[Tensor]) -> None:
        for i, b in enumerate(bs):
            tensors[f"{prefix}.{i}"] = b.detach().cpu().clone()  # shared snapshots: own copies

    put("a", state.a)
    put("best", state.best.b)
    for j, c in enumerate(state.candidates):
        put(f"trajectory{j}", c.b)
    candidates = [{k: v for k, v in asdict(c).items() if k != "b"} for c in state.candidates]
    for c in candidates:  # a candidate's best CE may be +inf (strict JSON: None)
        c["best_ce"] = c["best_ce"] if math.isfinite(c["best_ce"]) else None
    meta = {
        "iteration": state.iteration,
        "frozen_ce": state.frozen_ce,
        "num_blocks": len(state.a),
        "trajectories": candidates,
        "best": {k: getattr(state.best, k) for k in ("ce", "eta", "lam_rel", "iteration")},
        "history": state.history,
        "elapsed_s": state.elapsed_s,
        "recalibrations": state.recalibrations,
        "recalibration_s": state.recalibration_s,
        "maps": state.maps is not None,
    }
    write_fit_state(directory, tensors, meta, state.maps.save_pretrained if state.maps is not None else None)


def load_fit_state(directory: str | Path, parts: ModelParts) -> FitState:
    """Read a state written by :func:`save_fit_state` for the model ``parts`` (re-calibrated maps
    are checked against its fingerprint)."""
    directory = Path(directory)
    meta, tensors = read_fit_state(directory)
    n = meta["num_blocks"]
    if n != parts.num_blocks:
        raise ValueError(f"{directory}: a fit state for {n} blocks, the model has {parts.num_blocks}")

    def get(prefix: str) -> list[Tensor]:
        try:
            return [tensors[f"{prefix}.{i}"] for i in range(n)]
        except KeyError as exc:
            raise ValueError(f"{directory / FIT_STATE_CONFIG}: its tensors miss {exc}") from None

    candidates = [
        Candidate(
            **{**c, "best_ce": math.inf if c["best_ce"] is None else c["best_ce"], "b": get(f"trajectory{j}")}
        )
        for j, c in enumerate(meta["trajectories"])
    ]
    maps = None
    if meta["maps"]:
        maps = FeedbackMaps.from_pretrained(directory / "maps", parts)
    return FitState(
        iteration=meta["iteration"],
        frozen_ce=meta["frozen_ce"],
        candidates=candidates,
        best=Best(**meta["best"], b=get("best")),
        history=meta["history"],
        a=get("a"),
        elapsed_s=meta["elapsed_s"],
        recalibrations=meta["recalibrations"],
        recalibration_s=meta["recalibration_s"],
        maps=maps,
    )
