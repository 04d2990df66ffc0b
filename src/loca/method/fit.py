"""Stage II: forward-only fitting of the residual adapters, selected by held-out CE.

The fit iterates one explicit :class:`loca.method.state.FitState`: per iteration, each live
candidate takes one Stage II step (:func:`loca.method.stage2.stage2_pass`: one forward pass per
Gauss–Seidel group, then the ridge solves), its held-out CE is measured, the step control
(:mod:`loca.method.steps`) decides whether the step is kept and how η moves, and the pure
selection (:func:`loca.method.state.select`) keeps the best snapshot, the frozen model included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..config import LocaConfig
from ..core.ridge import BlockStats, NonFiniteStatisticsError
from ..data.batching import Batch
from ..eval.evaluation import completion_ce
from ..eval.metrics import TokenCE
from ..infra import distributed
from ..models.parts import ModelParts
from .a_init import principal_a
from .adapters import ResidualAdapters
from .calibrate import Calibrator
from .credit import Credit
from .graphs import batch_graphs
from .maps import FeedbackMaps
from .stage2 import block_groups, stage2_pass
from .state import Best, Candidate, FitState, select
from .steps import StepControl, step_control

Statistics = tuple[dict[int, BlockStats], TokenCE]  # a pass's first group: per-block stats, train CE


@dataclass
class FitResult:
    """What :func:`fit` returns. ``adapters`` hold the selected snapshot (B = 0 if nothing won)."""

    adapters: ResidualAdapters
    frozen_heldout_ce: float
    heldout_ce: float
    eta: float | None
    lam_rel: float | None
    best_iteration: int
    improved: bool
    history: list[dict] = field(default_factory=list)
    stop_reasons: dict[str, str] = field(default_factory=dict)
    wall_time_s: float = 0.0
    recalibrations: int = 0
    recalibration_time_s: float = 0.0
    graph_capture_s: float = 0.0  # spent capturing CUDA graphs (0 when eager)


class _Loop:
    """What one :func:`fit` call holds besides its state: the data, the current credit, the step
    control, CUDA graphs, the callbacks, and a cache of statistics that depend only on a
    candidate's B and the credit (never checkpointed: recomputed bit for bit after a resume)."""

    def __init__(self, parts, credit, train, heldout, cfg, adapters, calibrator, callbacks, start):
        self.parts, self.credit, self.train, self.heldout, self.cfg = parts, credit, train, heldout, cfg
        self.adapters, self.calibrator, self.start = adapters, calibrator, start
        self.on_iteration, self.on_improve = callbacks
        self.control: StepControl = step_control(cfg)
        self.groups = block_groups(parts.num_blocks, cfg.groups)
        self.train_graphs = self.heldout_graphs = None  # CUDA graphs, sharing one memory pool
        if cfg.cuda_graphs:
            self.train_graphs = batch_graphs(parts, adapters, train)
            self.heldout_graphs = batch_graphs(parts, adapters, heldout, self.train_graphs)
        self.cache: dict[int, tuple[object, list, Statistics]] = {}  # id(B) -> (credit, B, statistics)

    def log(self, state: FitState, row: dict) -> None:
        row["elapsed_s"] = time.perf_counter() - self.start
        state.history.append(row)
        if self.on_iteration:
            self.on_iteration(row)

    def heldout_ce(self) -> float:
        ce = completion_ce(self.parts, self.heldout, self.heldout_graphs).mean
        if not math.isfinite(ce):
            raise NonFiniteStatisticsError(f"held-out CE became {ce}")
        return ce

    def step(self, cand: Candidate) -> tuple[float, float]:
        """One Stage II step from ``cand.b`` with ``cand.eta``; leaves the adapters at the new B and
        returns ``(training CE at cand.b, held-out CE at the new B)``. The first group's statistics
        depend on ``cand.b`` and the credit only (not on η): they are cached for a retry, and every
        candidate at the same B shares them."""
        hit = self.cache.get(id(cand.b))
        first = hit[2] if hit is not None and hit[0] is self.credit and hit[1] is cand.b else None
        train_ce, first = stage2_pass(
            self.parts,
            self.adapters,
            self.credit,
            self.train,
            cand.b,
            cand.eta,
            cand.lam_rel,
            self.cfg,
            self.groups,
            first=first,
            graphs=self.train_graphs,
        )
        self.cache[id(cand.b)] = (self.credit, cand.b, first)
        return train_ce, self.heldout_ce()

    def iterate(self, state: FitState, on_checkpoint, progress: bool) -> None:
        """Iterations ``state.iteration + 1 .. max_iters`` (until every candidate stopped), with a
        progress bar and a state snapshot to ``on_checkpoint`` after each."""
        first, last = state.iteration + 1, self.cfg.max_iters
        off = not progress or not distributed.is_main()
        bar = tqdm(range(first, last + 1), desc="LoCA", unit="it", initial=first - 1, total=last, disable=off)
        try:
            for it in bar:
                if all(c.stopped for c in state.candidates):
                    break
                self.advance(state, it)
                bar.set_postfix(heldout_ce=f"{state.best.ce:.4f}", best_it=state.best.iteration)
                if on_checkpoint:
                    on_checkpoint(state.snapshot())
        finally:
            bar.close()

    def advance(self, state: FitState, it: int) -> None:
        """Iteration ``it``: one step of every live candidate, then the diagnostic if due."""
        for cand in state.candidates:
            if not cand.stopped:
                self.advance_one(state, cand, it)
        if self.cfg.alignment_every and it % self.cfg.alignment_every == 0:
            self.alignment(state, it)
        live = {id(c.b) for c in state.candidates}  # statistics of B that no candidate holds expire
        self.cache = {k: v for k, v in self.cache.items() if k in live}
        state.iteration = it
        state.elapsed_s = time.perf_counter() - self.start

    def advance_one(self, state: FitState, cand: Candidate, it: int) -> None:
        t0, error, eta = time.perf_counter(), None, cand.eta
        try:
            train_ce, ce = self.step(cand)
        except NonFiniteStatisticsError as exc:
            if self.control.stops_on_nonfinite:
                cand.stopped = f"non-finite at iteration {it}: {exc}"
                return
            train_ce, ce, error = math.nan, math.inf, str(exc)  # a rejected step
        improved = ce < cand.best_ce
        row = {
            "iteration": it,
            "eta": eta,
            "lam_rel": cand.lam_rel,
            "heldout_ce": ce,
            "train_ce": train_ce,
            "b_norm": self.adapters.norm(),
            "time_s": time.perf_counter() - t0,
        }
        if self.control.marks_acceptance:
            row["accepted"] = improved
        if error:
            row["heldout_ce"], row["train_ce"], row["error"] = None, None, error
        self.log(state, row)
        kept = self.control.keeps(improved)
        if kept:
            cand.b = self.adapters.get_b()
            best = select(state.best, ce, cand.b, cand, it)
            if best is not state.best:
                state.best = best
                if self.on_improve:
                    self.on_improve(self.adapters, row)
        self.control.after(cand, improved, ce)
        every = self.cfg.recalibrate_every
        if kept and every and cand.accepted % every == 0 and it < self.cfg.max_iters:
            self.recalibrate(state, cand.b)
        if cand.since_best >= self.cfg.patience:
            cand.stopped = f"patience ({self.cfg.patience}) at iteration {it}"

    def recalibrate(self, state: FitState, b: list[torch.Tensor]) -> None:
        """Refit the credit at adapters ``b`` (one probe backward pass); cached statistics expire."""
        t0 = time.perf_counter()
        self.adapters.set_b(b)
        self.credit = state.maps = self.calibrator.refit()
        state.recalibrations += 1
        state.recalibration_s += time.perf_counter() - t0

    def alignment(self, state: FitState, it: int) -> None:
        """The diagnostic: the current maps' held-out alignment at the best snapshot's B."""
        t0 = time.perf_counter()
        self.adapters.set_b(state.best.b)
        per_block = self.calibrator.heldout_alignment(self.credit)
        self.log(
            state,
            {
                "iteration": it,
                "diagnostic": "heldout_alignment",
                "alignment": per_block,
                "median": sorted(per_block)[len(per_block) // 2],
                "time_s": time.perf_counter() - t0,
            },
        )

    def start_state(self) -> FitState:
        """Iteration 0: the frozen model's held-out CE, every candidate at B = 0."""
        frozen_ce = completion_ce(self.parts, self.heldout, self.heldout_graphs).mean
        if not math.isfinite(frozen_ce):
            raise NonFiniteStatisticsError(f"the frozen model's held-out CE is {frozen_ce}")
        zero = self.adapters.get_b()
        state = FitState(
            0,
            frozen_ce,
            self.control.candidates(frozen_ce, zero),
            Best(frozen_ce, zero),
            a=[x.cpu() for x in self.adapters.A],
        )
        self.log(
            state,
            {
                "iteration": 0,
                "eta": None,
                "lam_rel": None,
                "heldout_ce": frozen_ce,
                "train_ce": None,
                "b_norm": 0.0,
            },
        )
        return state

    def result(self, state: FitState) -> FitResult:
        for c in state.candidates:
            c.stopped = c.stopped or f"max_iters ({self.cfg.max_iters})"
        graphs = (self.train_graphs, self.heldout_graphs)
        return FitResult(
            self.adapters,
            state.frozen_ce,
            state.best.ce,
            state.best.eta,
            state.best.lam_rel,
            state.best.iteration,
            improved=state.best.iteration > 0,
            history=state.history,
            stop_reasons={self.control.label(c): c.stopped for c in state.candidates},
            wall_time_s=time.perf_counter() - self.start,
            recalibrations=state.recalibrations,
            recalibration_time_s=state.recalibration_s,
            graph_capture_s=sum(g.capture_s for g in graphs if g is not None),
        )


def check_rank(rank: int, parts: ModelParts) -> None:
    """Refuse an adapter rank above the model's hidden size d (A is r×d: at most d independent
    directions, and an adapter of higher rank is refused when loaded), before any work."""
    if rank > parts.hidden_size:
        raise ValueError(
            f"--rank {rank} is larger than the model's hidden size {parts.hidden_size}: the adapter "
            f"rank must be 1..{parts.hidden_size}; choose --rank {parts.hidden_size} or less"
        )


def _check(parts: ModelParts, credit: Credit, train, heldout, cfg: LocaConfig, calibrator) -> None:
    check_rank(cfg.rank, parts)
    if not train:
        raise ValueError("the training set is empty")
    if not heldout:
        raise ValueError("the held-out set is empty")
    if credit.num_blocks != parts.num_blocks or credit.projection(0).shape[0] != parts.hidden_size:
        raise ValueError("the feedback maps do not match this model's blocks")
    if (cfg.recalibrate_every or cfg.alignment_every) and calibrator is None:
        raise ValueError("recalibrate_every and alignment_every need a Calibrator (fit(..., calibrator=))")


def _resumed(state: FitState) -> FitState:
    """``state`` with every all-zero B as one shared list, as a fresh fit has them (the candidates at
    B = 0 then share the first pass's statistics)."""
    zero = next((c.b for c in state.candidates if all(not x.any() for x in c.b)), None)
    same = lambda b: zero if zero is not None and all(not x.any() for x in b) else [x.clone() for x in b]  # noqa: E731
    for c in state.candidates:
        c.b = same(c.b)
    state.best = Best(
        state.best.ce, same(state.best.b), state.best.eta, state.best.lam_rel, state.best.iteration
    )
    return state


def _adapters(parts: ModelParts, train, cfg: LocaConfig, resume: FitState | None) -> ResidualAdapters:
    """A fresh set: the resumed fit's A, or principal or random A."""
    if resume is not None:
        a = resume.a
    else:
        a = principal_a(parts, train, cfg.rank, cfg.seed) if cfg.a_init == "principal" else None
    return ResidualAdapters(parts, rank=cfg.rank, seed=cfg.seed, a=a)


def fit(
    parts: ModelParts,
    maps: FeedbackMaps | Credit,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    cfg: LocaConfig | None = None,
    *,
    calibrator: Calibrator | None = None,
    on_iteration: Callable[[dict], None] | None = None,
    on_improve: Callable[[ResidualAdapters, dict], None] | None = None,
    on_checkpoint: Callable[[FitState], None] | None = None,
    resume: FitState | None = None,
    adapters: ResidualAdapters | None = None,
    progress: bool = True,
) -> FitResult:
    """Fit the adapters forward-only and select (η, λ, iteration) by held-out CE, the frozen model
    included; the best snapshot is restored whatever happens (adapters the fit made itself are
    detached on an error). ``calibrator``: for re-calibration and the alignment diagnostic only.
    ``on_iteration`` gets each history row, ``on_improve`` the adapters at each new best,
    ``on_checkpoint`` a :class:`FitState` snapshot per iteration, which ``resume`` continues (same
    data and ``cfg``). ``adapters``: an existing set to fit (A kept, B reset)."""
    cfg = cfg or LocaConfig()
    _check(parts, maps, train, heldout, cfg, calibrator)
    start = time.perf_counter() - (resume.elapsed_s if resume else 0.0)
    created = adapters is None or resume is not None  # detached again if the fit fails
    adapters = _adapters(parts, train, cfg, resume) if created else adapters
    adapters.attach().reset()
    credit = (resume and resume.maps) or maps
    loop = _Loop(parts, credit, train, heldout, cfg, adapters, calibrator, (on_iteration, on_improve), start)
    try:
        state = _resumed(resume.snapshot()) if resume else loop.start_state()
    except BaseException:
        adapters.detach()
        raise
    try:
        loop.iterate(state, on_checkpoint, progress)
    except BaseException:
        if created:  # nobody holds these adapters: leave the model as it was
            adapters.detach()
        raise
    finally:
        adapters.set_b(state.best.b)
    return loop.result(state)
