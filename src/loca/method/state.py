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


def save_fit_state(state: FitState, directory: str | Path, run: dict | None = None) -> None:
    """Write ``state`` to ``directory`` (replaced in one rename). ``run``: what the state belongs to
    (a run folder records the model's fingerprint, the data's content fingerprint and the resolved
    LoCA configuration), checked by :func:`load_fit_state` before a resume."""
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
        **({"run": run} if run is not None else {}),
    }
    write_fit_state(directory, tensors, meta, state.maps.save_pretrained if state.maps is not None else None)


# what ``run`` records, in the words of the errors
RUN_PARTS = {"model": "model checkpoint", "data": "training/held-out data", "loca": "LoCA settings"}


def load_fit_state(directory: str | Path, parts: ModelParts, run: dict | None = None) -> FitState:
    """Read a state written by :func:`save_fit_state` for the model ``parts`` (re-calibrated maps
    are checked against its fingerprint). A partial, damaged or self-contradicting state (its
    iteration against its own history, tensors of the wrong shape) is a ValueError naming the
    file. With ``run`` (the ``run`` it must have been saved with), a state saved with another
    model, other data or other settings, or without that record, is refused too."""
    directory = Path(directory)
    path = directory / FIT_STATE_CONFIG
    meta, tensors = read_fit_state(directory)
    n = meta["num_blocks"]
    if n != parts.num_blocks:
        raise ValueError(f"{directory}: a fit state for {n} blocks, the model has {parts.num_blocks}")
    if run is not None:
        _check_run(meta.get("run"), run, path)
    d = parts.hidden_size
    rank = tensors["a.0"].shape[0] if "a.0" in tensors else None

    def get(prefix: str) -> list[Tensor]:
        try:
            out = [tensors[f"{prefix}.{i}"] for i in range(n)]
        except KeyError as exc:
            raise ValueError(f"{path}: its tensors miss {exc}") from None
        want = (rank, d) if prefix == "a" else (d, rank)
        if any(tuple(t.shape) != want for t in out):
            raise ValueError(f"{path}: {prefix} tensors are not {want[0]}×{want[1]} (a damaged fit state)")
        return out

    a = get("a")
    try:
        candidates = [
            Candidate(
                **{
                    **c,
                    "best_ce": math.inf if c["best_ce"] is None else c["best_ce"],
                    "b": get(f"trajectory{j}"),
                }
            )
            for j, c in enumerate(meta["trajectories"])
        ]
        best = Best(**meta["best"], b=get("best"))
    except (TypeError, KeyError) as exc:
        raise ValueError(f"{path}: malformed trajectories or best ({exc}); it cannot be resumed") from None
    state = FitState(
        iteration=meta["iteration"],
        frozen_ce=meta["frozen_ce"],
        candidates=candidates,
        best=best,
        history=meta["history"],
        a=a,
        elapsed_s=meta["elapsed_s"],
        recalibrations=meta["recalibrations"],
        recalibration_s=meta["recalibration_s"],
    )
    _check_consistent(state, path, run)
    if meta["maps"]:
        state.maps = FeedbackMaps.from_pretrained(directory / "maps", parts)
    return state


def _check_run(saved, run: dict, path: Path) -> None:
    """Refuse a state whose ``run`` record differs from this run's (or that has none)."""
    if not isinstance(saved, dict):
        raise ValueError(
            f"{path}: records no model, data and settings fingerprint (written by an older loca or "
            "edited), so it cannot be checked against this run; it cannot be resumed"
        )
    for key, what in RUN_PARTS.items():
        if saved.get(key) == run.get(key):
            continue
        detail = ""
        if key == "loca" and isinstance(saved.get(key), dict):
            diff = sorted(k for k in set(saved[key]) | set(run[key]) if saved[key].get(k) != run[key].get(k))
            detail = f" (differs in: {', '.join(diff)})"
        raise ValueError(
            f"{path}: this fit state was made with other {what} than the run resuming it{detail}; "
            "it cannot be resumed (start the run again with --overwrite, or use another --out)"
        )


def _check_consistent(state: FitState, path: Path, run: dict | None) -> None:
    """A state's iteration agrees with its own history and selection: its history starts at the
    frozen model (iteration 0), its last row is at ``iteration`` (or one before, when every
    trajectory stopped on a non-finite step and logged nothing), the best snapshot is not from
    later, and, with ``run``, ``iteration`` is within ``max_iters``."""
    rows = [r.get("iteration") if isinstance(r, dict) else None for r in state.history]
    if not rows or not all(isinstance(i, int) and not isinstance(i, bool) for i in rows) or rows[0] != 0:
        raise ValueError(f"{path}: its history is malformed (a partial or edited fit state); cannot resume")
    it, last = state.iteration, max(rows)
    stopped = all(c.stopped for c in state.candidates)
    max_iters = ((run or {}).get("loca") or {}).get("max_iters")
    if (
        not (it == last or (it == last + 1 and stopped))
        or not 0 <= state.best.iteration <= it
        or (isinstance(max_iters, int) and it > max_iters)
    ):
        raise ValueError(
            f"{path}: its iteration ({it}) contradicts its history (last row at iteration {last}) or "
            f"its selection (best at iteration {state.best.iteration}): an edited fit state; it cannot "
            "be resumed"
        )
