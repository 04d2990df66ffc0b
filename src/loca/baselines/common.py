"""What every method of a comparison shares: the training loss, held-out selection with a best
snapshot (the frozen model included), and the result record.

Every method trains on the same :class:`~loca.data.batching.Batch` objects that LoCA fits on, with
the same loss (mean per-token CE over the completion tokens, answer + EOS, at the predict
positions), and is selected by the same held-out CE (:func:`loca.eval.evaluation.completion_ce`).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Self

import torch

from ..data.batching import Batch
from ..eval.evaluation import completion_ce, position_losses
from ..method.adapters import ResidualAdapters
from ..models.parts import ModelParts


def completion_loss(parts: ModelParts, batch: Batch) -> torch.Tensor:
    """Mean per-token CE over the batch's completion tokens (differentiable when grad is on)."""
    return position_losses(parts, batch).mean()


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The seeded order of ``n`` training batches in ``epoch`` (1-based), the same for every
    candidate: the backprop baselines (LoRA, Adapter-BP) see the batches in one order per seed."""
    key = hashlib.sha256(f"loca-lora-shuffle:{seed}:{epoch}".encode()).digest()[:8]
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") & (2**63 - 1))
    return torch.randperm(n, generator=gen).tolist()


@dataclass
class RestorableRun:
    """What a fit that leaves the model in its selected state returns: the result, the adapters it
    fitted (None when it edited the weights), and how to undo it. :meth:`restore` (or leaving a
    ``with`` block) puts the model back as it was, once."""

    result: MethodResult
    adapters: ResidualAdapters | None = None
    _undo: Callable[[], None] | None = field(default=None, repr=False)

    def restore(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


@dataclass
class MethodResult:
    """What a method's fit returns, after it has left the model in its selected state.

    ``best_step`` counts ``step_unit`` (iteration, epoch, step) of the selected candidate; 0 means
    the frozen model won (``improved`` is False and ``selected`` is empty). ``history`` holds one
    row per held-out evaluation: ``candidate`` (dict), ``step``, ``heldout_ce``, ``elapsed_s``
    (since the method started) and method-specific keys (e.g. ``train_loss``).
    """

    method: str
    frozen_heldout_ce: float
    heldout_ce: float
    selected: dict
    best_step: int
    step_unit: str
    improved: bool
    time_to_best_s: float
    wall_time_s: float
    history: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class HeldoutSelector:
    """Held-out CE after every epoch/step block of every candidate, and the best snapshot.

    ``snapshot()`` returns a copy of the trainable state (on the CPU), ``restore(state)`` puts one
    back. Call :meth:`evaluate` once before training (the frozen model: candidate None, step 0),
    then after each evaluation point; :meth:`restore_best` puts the best state back (use it in a
    ``finally``). A non-finite held-out CE never becomes the best; :meth:`evaluate` returns it so
    the caller can stop that candidate.
    """

    def __init__(
        self,
        parts: ModelParts,
        heldout: Sequence[Batch],
        snapshot: Callable[[], Any],
        restore: Callable[[Any], None],
        on_row: Callable[[dict], None] | None = None,
    ):
        if not heldout:
            raise ValueError("the held-out set is empty")
        self.parts, self.heldout = parts, heldout
        self.snapshot, self.restore = snapshot, restore
        self.on_row = on_row
        self.start = time.perf_counter()
        self.history: list[dict] = []
        self.best_ce = math.inf
        self.best_state: Any = None
        self.best_candidate: dict | None = None
        self.best_step = 0
        self.best_elapsed = 0.0
        self.frozen_ce: float | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def evaluate(self, candidate: dict | None, step: int, **extra) -> float:
        ce = completion_ce(self.parts, self.heldout).mean
        elapsed = self.elapsed()
        if self.frozen_ce is None:
            if not math.isfinite(ce):
                raise FloatingPointError(f"the frozen model's held-out CE is {ce}")
            self.frozen_ce = ce
        row = {"candidate": candidate, "step": step, "heldout_ce": ce, "elapsed_s": elapsed, **extra}
        self.history.append(row)
        if self.on_row:
            self.on_row(row)
        if math.isfinite(ce) and ce < self.best_ce:
            self.best_ce, self.best_state = ce, self.snapshot()
            self.best_candidate, self.best_step, self.best_elapsed = candidate, step, elapsed
        return ce

    def restore_best(self) -> None:
        if self.best_state is not None:
            self.restore(self.best_state)

    def result(self, method: str, step_unit: str, last_iterate: bool = False, **extra) -> MethodResult:
        """The selected state's record; ``last_iterate``: the last evaluation's instead (a method
        that keeps its final state, selecting nothing; ``improved`` then means it beats the frozen
        model's held-out CE)."""
        if last_iterate and len(self.history) > 1:
            last = self.history[-1]
            ce = last["heldout_ce"]
            return MethodResult(
                method=method,
                frozen_heldout_ce=float(self.frozen_ce),
                heldout_ce=ce,
                selected=dict(last["candidate"] or {}),
                best_step=last["step"],
                step_unit=step_unit,
                improved=math.isfinite(ce) and ce < self.frozen_ce,
                time_to_best_s=last["elapsed_s"],
                wall_time_s=self.elapsed(),
                history=self.history,
                extra={**extra, "last_iterate": True},
            )
        improved = self.best_candidate is not None
        return MethodResult(
            method=method,
            frozen_heldout_ce=float(self.frozen_ce),
            heldout_ce=self.best_ce,
            selected=dict(self.best_candidate or {}),
            best_step=self.best_step if improved else 0,
            step_unit=step_unit,
            improved=improved,
            time_to_best_s=self.best_elapsed,
            wall_time_s=self.elapsed(),
            history=self.history,
            extra=extra,
        )
