"""A fit's resumable state on disk: :class:`loca.method.fit.FitState` as ``fit_state.safetensors`` (A and
every B: the trajectories' and the best snapshot's) and ``fit_state.json`` (the rest), written
atomically after every iteration. Re-calibrated maps, if any, go to ``maps/`` beside them."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..infra.io import atomic_dir, atomic_write_json
from ..models.parts import ModelParts
from .adapters import read_json_object, read_safetensors
from .calibrate import MAPS_CONFIG, FeedbackMaps
from .fit import FitState

STATE_WEIGHTS = "fit_state.safetensors"
STATE_CONFIG = "fit_state.json"
FORMAT = "loca-fit-state"


def save_fit_state(state: FitState, directory: str | Path) -> None:
    """Write ``state`` to ``directory`` (replaced in one rename)."""
    tensors: dict[str, torch.Tensor] = {}

    def put(prefix: str, bs: list[torch.Tensor]) -> None:
        for i, b in enumerate(bs):
            tensors[f"{prefix}.{i}"] = b.detach().cpu().clone()  # shared snapshots: own copies

    put("a", state.a)
    put("best", state.best["b"])
    for j, t in enumerate(state.trajectories):
        put(f"trajectory{j}", t["b"])
    meta = {
        "format": FORMAT,
        "version": 1,
        "iteration": state.iteration,
        "frozen_ce": state.frozen_ce,
        "num_blocks": len(state.a),
        "trajectories": [{k: v for k, v in t.items() if k != "b"} for t in state.trajectories],
        "best": {k: v for k, v in state.best.items() if k != "b"},
        "history": state.history,
        "elapsed_s": state.elapsed_s,
        "recalibrations": state.recalibrations,
        "recalibration_s": state.recalibration_s,
        "maps": state.maps is not None,
    }
    for t in meta["trajectories"]:  # a trajectory's best CE may be +inf (strict JSON: None)
        t["best_ce"] = t["best_ce"] if math.isfinite(t["best_ce"]) else None
    with atomic_dir(directory, STATE_CONFIG, FORMAT) as tmp:
        save_file(tensors, tmp / STATE_WEIGHTS)
        if state.maps is not None:
            state.maps.save_pretrained(tmp / "maps")
        atomic_write_json(tmp / STATE_CONFIG, meta)


def load_fit_state(directory: str | Path, parts: ModelParts) -> FitState:
    """Read a state written by :func:`save_fit_state` for the model ``parts`` (re-calibrated maps
    are checked against its fingerprint)."""
    directory = Path(directory)
    meta = read_json_object(directory / STATE_CONFIG)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory / STATE_CONFIG}: not a LoCA fit state")
    tensors = read_safetensors(directory / STATE_WEIGHTS)
    n = meta["num_blocks"]
    if n != parts.num_blocks:
        raise ValueError(f"{directory}: a fit state for {n} blocks, the model has {parts.num_blocks}")

    def get(prefix: str) -> list[torch.Tensor]:
        try:
            return [tensors[f"{prefix}.{i}"] for i in range(n)]
        except KeyError as exc:
            raise ValueError(f"{directory / STATE_WEIGHTS}: missing {exc}") from None

    trajectories = [
        {**t, "best_ce": math.inf if t["best_ce"] is None else t["best_ce"], "b": get(f"trajectory{j}")}
        for j, t in enumerate(meta["trajectories"])
    ]
    maps = None
    if meta["maps"]:
        if not (directory / "maps" / MAPS_CONFIG).is_file():
            raise ValueError(f"{directory}: the re-calibrated maps are missing")
        maps = FeedbackMaps.from_pretrained(directory / "maps", parts)
    return FitState(
        iteration=meta["iteration"],
        frozen_ce=meta["frozen_ce"],
        trajectories=trajectories,
        best={**meta["best"], "b": get("best")},
        history=meta["history"],
        a=get("a"),
        elapsed_s=meta["elapsed_s"],
        recalibrations=meta["recalibrations"],
        recalibration_s=meta["recalibration_s"],
        maps=maps,
    )
