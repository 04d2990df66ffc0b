"""Step controls: how a fit's candidates are laid out and how each one's step size moves.

A step control makes the candidates a fit starts with and, after each step, says whether the step's
B is kept and updates the candidate's step size and patience count. ``fixed`` runs one trajectory
per η candidate and keeps every step (the paper); ``adaptive`` runs one trajectory per ridge whose
η grows after every step that lowers its held-out CE and shrinks, with B restored, after one that
does not (a rejected step is retried on the same statistics: a held-out pass, not a training
pass). A new rule is a new class here, registered in :data:`STEP_CONTROLS`.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ..config import LocaConfig
from .state import Candidate


class StepControl(Protocol):
    stops_on_nonfinite: bool  # a non-finite step stops its candidate (else: a rejected step)
    marks_acceptance: bool  # history rows say whether the step was kept

    def candidates(self, frozen_ce: float, zero: list[Tensor]) -> list[Candidate]:
        """The fit's candidates, all at B = ``zero`` (the frozen model's held-out CE as their best)."""
        ...

    def keeps(self, improved: bool) -> bool:
        """Whether a step's new B replaces the candidate's (``improved``: it lowered its CE)."""
        ...

    def after(self, cand: Candidate, improved: bool, ce: float) -> None:
        """Update ``cand``'s step size, best CE and patience count after a step."""
        ...

    def label(self, cand: Candidate) -> str:
        """The candidate's name in the fit's stop reasons."""
        ...


class FixedStep:
    """One trajectory per (η, λ) pair, every step kept (the paper's control)."""

    stops_on_nonfinite = True
    marks_acceptance = False

    def __init__(self, cfg: LocaConfig):
        self.cfg = cfg

    def candidates(self, frozen_ce: float, zero: list[Tensor]) -> list[Candidate]:
        return [Candidate(eta, lam, zero, frozen_ce) for eta in self.cfg.etas for lam in self.cfg.lam_rel]

    def keeps(self, improved: bool) -> bool:
        return True

    def after(self, cand: Candidate, improved: bool, ce: float) -> None:
        if improved:
            cand.best_ce, cand.since_best = ce, 0
        else:
            cand.since_best += 1

    def label(self, cand: Candidate) -> str:
        return f"eta={cand.eta:g},lam_rel={cand.lam_rel:g}"


class AdaptiveStep:
    """One trajectory per λ from ``etas[0]``: η × ``eta_grow`` after a kept step, × ``eta_shrink``
    (B restored) after a rejected one."""

    stops_on_nonfinite = False
    marks_acceptance = True

    def __init__(self, cfg: LocaConfig):
        self.cfg = cfg

    def candidates(self, frozen_ce: float, zero: list[Tensor]) -> list[Candidate]:
        return [Candidate(self.cfg.etas[0], lam, zero, frozen_ce) for lam in self.cfg.lam_rel]

    def keeps(self, improved: bool) -> bool:
        return improved

    def after(self, cand: Candidate, improved: bool, ce: float) -> None:
        if improved:
            cand.best_ce, cand.since_best = ce, 0
            cand.eta *= self.cfg.eta_grow
            cand.accepted += 1
        else:
            cand.eta *= self.cfg.eta_shrink
            cand.since_best += 1

    def label(self, cand: Candidate) -> str:
        return f"adaptive,lam_rel={cand.lam_rel:g}"


STEP_CONTROLS: dict[str, type] = {"fixed": FixedStep, "adaptive": AdaptiveStep}  # LocaConfig.step_control


def step_control(cfg: LocaConfig) -> StepControl:
    """The step control ``cfg.step_control`` names."""
    return STEP_CONTROLS[cfg.step_control](cfg)
