"""Stage II: forward-only fitting of the residual adapters with closed-form ridge solves.

Each outer iteration is one inference-mode forward pass over the training data per Gauss–Seidel
group (one pass in total for the default Jacobi schedule). During the pass every block records
``p = A h_{l-1}`` at the predict positions; after it, the head error ``e`` gives the local targets
through the feedback maps. Only ``G = Σ p pᵀ`` (r×r) and ``Σ s·Y P`` (k×r) persist per block.

Two step controls select η (``LocaConfig.step_control``): ``fixed`` runs one trajectory per η
candidate (the paper); ``adaptive`` runs one trajectory whose η grows after every step that lowers
the held-out CE and shrinks, with B restored, after one that does not. The new B is linear in η
given a pass's statistics, so a rejected step is retried on the same statistics: it costs a
held-out pass, not a training pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..config import LocaConfig
from ..core import stacked
from ..core.head import head_loss_and_error
from ..core.ridge import BlockStats, NonFiniteStatisticsError, solve_block
from ..data.batching import Batch
from ..eval.evaluation import completion_ce, reduce_ce
from ..eval.metrics import TokenCE
from ..infra import distributed
from ..models.parts import ModelParts
from .adapters import Recorder, ResidualAdapters, principal_a
from .calibrate import Calibrator, FeedbackMaps
from .graphs import BatchGraphs, batch_graphs


def block_groups(num_blocks: int, groups: int) -> list[list[int]]:
    """Split blocks 0..L-1 into ``groups`` contiguous, near-equal groups (input side first)."""
    groups = min(groups, num_blocks)
    bounds = [round(i * num_blocks / groups) for i in range(groups + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(groups)]


def _by_device(adapters: ResidualAdapters, blocks: Sequence[int]) -> dict[torch.device, list[int]]:
    """``blocks`` grouped by the device they live on (in order)."""
    out: dict[torch.device, list[int]] = {}
    for l in blocks:
        out.setdefault(adapters.devices[l], []).append(l)
    return out


def _batch_outputs(
    parts: ModelParts, adapters: ResidualAdapters, maps: FeedbackMaps, b: Batch,
    by_device: dict[torch.device, list[int]], consts: dict[torch.device, tuple[Tensor, Tensor]],
) -> tuple[Tensor, list[tuple[Tensor, Tensor, Tensor]]]:  # fmt: skip
    """The per-batch part of a Stage II pass (what a CUDA graph captures): the forward with the
    adapters and the recording hooks, the head loss and error, and per device the codes
    ``p`` (L×N×r), input norms² (L) and projected errors ``y = E V_k`` (L×N×k)."""
    stacks = {dev: (ls, consts[dev][1]) for dev, ls in by_device.items()}
    with adapters.recording(Recorder(b.pos_b, b.pos_t, b.input_ids.shape[1], stacks)) as rec:
        hn = parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t)
    loss, e = head_loss_and_error(hn, parts.head.weight, parts.head.bias, b.targets, parts.transform)
    mask = maps.mask(b.roles)  # gated maps: each position's own map's columns
    outs = []
    for dev, ls in by_device.items():
        v_all = consts[dev][0]
        p, h_sumsq = rec.codes_and_norms(dev)
        e_dev = e if e.device == dev else e.to(dev)
        y = (e_dev @ v_all.to(e_dev.dtype)).view(-1, len(ls), v_all.shape[1] // len(ls)).transpose(0, 1)
        if mask is not None:
            y = y * mask.to(device=dev, dtype=y.dtype)
        outs.append((p, h_sumsq, y))
    return loss, outs


@torch.inference_mode()
def collect_statistics(
    parts: ModelParts,
    adapters: ResidualAdapters,
    maps: FeedbackMaps,
    batches: Sequence[Batch],
    blocks: Sequence[int],
    step_scale: str = "rms",
    graphs: BatchGraphs | None = None,
) -> tuple[dict[int, BlockStats], TokenCE]:
    """One forward pass: per-block statistics for ``blocks`` and the training CE before the update.

    The hooks only gather each block's input rows at the predict positions (one kernel per
    block); the codes p = A h and input norms are formed for a few blocks at a time
    (:class:`loca.method.adapters.Recorder`), the statistics of all blocks on a device as one stack,
    and nothing is copied to the host inside the loop, so a GPU never waits on Python. With
    ``graphs`` (made for these ``batches``) each batch's forward, head error and codes replay a
    CUDA graph. Data-parallel: each rank runs its share of the batches, and the statistics and
    CE sums are all-reduced once (float64) after the pass.
    """
    by_device = _by_device(adapters, blocks)
    k = maps.width  # gated maps: their columns side by side
    stats = {dev: BlockStats.zeros(adapters.rank, k, dev, blocks=len(ls)) for dev, ls in by_device.items()}
    sigma = {dev: torch.stack([maps.sigma(l) for l in ls]) for dev, ls in by_device.items()}  # L × k
    consts = {  # per device: all V_k side by side (d × L·k), A stacked (L × r × d); views, not copies
        dev: (stacked.cat([maps.factors[l].v for l in ls], dim=1), stacked.stack([adapters.A[l] for l in ls]))
        for dev, ls in by_device.items()
    }
    if graphs is not None:  # a graph reads them from fixed buffers (one device)
        consts = {dev: graphs.fixed(tuple(blocks), *c) for dev, c in consts.items()}

    def outputs(batch: Batch) -> tuple:
        return _batch_outputs(parts, adapters, maps, batch, by_device, consts)

    losses, eos = [], []
    for index in distributed.owned(len(batches)):
        if graphs is not None:
            loss, outs = graphs.run(index, outputs, key=tuple(blocks))
            loss = loss.clone()  # the graph's buffer is rewritten by its next replay
        else:
            loss, outs = outputs(batches[index].to(parts.device))
        losses.append(loss)
        eos.append(batches[index].is_eos.to(loss.device))
        for (dev, st), (p, h_sumsq, y) in zip(stats.items(), outs, strict=True):
            st.add_inputs(p)
            st.add_targets(p, h_sumsq, y, sigma[dev], normalize=step_scale == "rms")
    ce = TokenCE()
    if losses:
        ce.add(torch.cat(losses), torch.cat(eos))
    # data-parallel: the statistics of all blocks in one sum over the ranks, the CE sums in another
    distributed.all_reduce_sum(*[t for st in stats.values() for t in (st.gram, st.cross)])
    ce = reduce_ce(ce)
    for st in stats.values():
        st.positions = ce.tokens  # every block saw every predict position
    out = {}
    for dev, ls in by_device.items():
        for i, l in enumerate(ls):
            out[l] = stats[dev][i]
    return out, ce


def solve_blocks(
    adapters: ResidualAdapters, maps: FeedbackMaps, stats: dict[int, BlockStats], blocks: Sequence[int],
    eta: float, lam_rel: float, center: str, budget_mb: float = 64.0,
) -> None:  # fmt: skip
    """Replace ``B_l`` of every block in ``blocks`` by its ridge solve, in place: batched solves
    (:func:`loca.core.ridge.solve_block` on a stack) per device, over as many blocks at a time as keep
    the solve's float64 d×r temporaries (about six per block) within ``budget_mb``."""
    d, r = adapters.parts.hidden_size, adapters.rank
    step = max(1, int(budget_mb * 2**20 // (6 * d * r * 8)))
    for on_device in _by_device(adapters, blocks).values():
        for i in range(0, len(on_device), step):
            ls = on_device[i : i + step]
            gram, cross = (stacked.stack([getattr(stats[l], f) for l in ls]) for f in ("gram", "cross"))
            b = stacked.stack([adapters.B[l] for l in ls])
            us = stacked.stack([maps.factors[l].us for l in ls])
            new = solve_block(b, BlockStats(gram, cross), us, eta, lam_rel, center)
            stacked.assign([adapters.B[l] for l in ls], new)


def stage2_pass(
    parts: ModelParts,
    adapters: ResidualAdapters,
    maps: FeedbackMaps,
    train: Sequence[Batch],
    b: list[torch.Tensor],
    eta: float,
    lam_rel: float,
    cfg: LocaConfig,
    groups: list[list[int]] | None = None,
    first: tuple[dict[int, BlockStats], TokenCE] | None = None,
    graphs: BatchGraphs | None = None,
) -> tuple[float, tuple[dict[int, BlockStats], TokenCE]]:
    """One Stage II step: from adapters ``b``, one Gauss–Seidel sweep over ``groups`` (default
    ``block_groups(L, cfg.groups)``): a forward pass per group collecting its blocks' statistics,
    then each block's ridge solve with step ``eta``. Leaves the adapters at the new B and returns
    ``(training CE at b, the first group's statistics)``; pass those back as ``first`` to retry
    from the same ``b`` with another η without a new forward pass. ``graphs``: CUDA graphs made
    for ``train`` (:class:`loca.method.graphs.BatchGraphs`). This is the step :func:`fit` takes and
    ``loca bench`` times."""
    groups = groups or block_groups(parts.num_blocks, cfg.groups)
    adapters.set_b(b)
    train_ce = math.nan
    for gi, blocks in enumerate(groups):
        if gi == 0 and first is not None:
            stats, ce = first
        else:
            stats, ce = collect_statistics(parts, adapters, maps, train, blocks, cfg.step_scale, graphs)
            if gi == 0:
                first = (stats, ce)
        if gi == 0:
            train_ce = ce.mean
        solve_blocks(adapters, maps, stats, blocks, eta, lam_rel, cfg.ridge_center)
    return train_ce, first


@dataclass
class Trajectory:
    """One candidate's state: its step size, ridge, current B and best held-out CE."""

    eta: float
    lam_rel: float
    b: list[torch.Tensor]
    best_ce: float
    since_best: int = 0
    stopped: str | None = None
    stats0: tuple[dict[int, BlockStats], TokenCE] | None = None  # first group's pass at b
    accepted: int = 0


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

    def summary(self) -> dict:
        return {
            "frozen_heldout_ce": self.frozen_heldout_ce,
            "heldout_ce": self.heldout_ce,
            "eta": self.eta,
            "lam_rel": self.lam_rel,
            "best_iteration": self.best_iteration,
            "improved": self.improved,
            "b_norm": self.adapters.norm(),
            "stop_reasons": self.stop_reasons,
            "wall_time_s": self.wall_time_s,
            "recalibrations": self.recalibrations,
            "recalibration_time_s": self.recalibration_time_s,
            "graph_capture_s": self.graph_capture_s,
        }


class _Fit:
    """The state one :func:`fit` call shares between its candidates."""

    def __init__(self, parts, maps, train, heldout, cfg, adapters, calibrator, on_iteration, start):
        self.parts, self.maps, self.train, self.heldout, self.cfg = parts, maps, train, heldout, cfg
        self.adapters, self.calibrator, self.on_iteration = adapters, calibrator, on_iteration
        self.groups = block_groups(parts.num_blocks, cfg.groups)
        self.train_graphs = self.heldout_graphs = None  # CUDA graphs, sharing one memory pool
        if cfg.cuda_graphs:
            self.train_graphs = batch_graphs(parts, adapters, train)
            self.heldout_graphs = batch_graphs(parts, adapters, heldout, self.train_graphs)
        self.history: list[dict] = []
        self.start = start
        self.recalibrations, self.recalibration_s = 0, 0.0

    def log(self, row: dict) -> None:
        row["elapsed_s"] = time.perf_counter() - self.start
        self.history.append(row)
        if self.on_iteration:
            self.on_iteration(row)

    def heldout_ce(self) -> float:
        ce = completion_ce(self.parts, self.heldout, self.heldout_graphs).mean
        if not math.isfinite(ce):
            raise NonFiniteStatisticsError(f"held-out CE became {ce}")
        return ce

    def step(self, traj: Trajectory, eta: float) -> tuple[float, float]:
        """One Stage II step from ``traj.b`` with step ``eta`` (:func:`stage2_pass`); leaves the
        adapters at the new B and returns ``(training CE at traj.b, held-out CE at the new B)``.
        The first group's statistics are cached on the trajectory: they depend on ``traj.b``
        only, not on η."""
        train_ce, traj.stats0 = stage2_pass(
            self.parts, self.adapters, self.maps, self.train, traj.b, eta, traj.lam_rel, self.cfg,
            self.groups, first=traj.stats0, graphs=self.train_graphs,
        )  # fmt: skip
        return train_ce, self.heldout_ce()

    def row(self, it: int, traj: Trajectory, eta: float, train_ce: float, ce: float, t0: float) -> dict:
        return {
            "iteration": it,
            "eta": eta,
            "lam_rel": traj.lam_rel,
            "heldout_ce": ce,
            "train_ce": train_ce,
            "b_norm": self.adapters.norm(),
            "time_s": time.perf_counter() - t0,
        }

    def recalibrate(self, b: list[torch.Tensor]) -> None:
        """Refit the maps at adapters ``b`` (one probe backward pass)."""
        t0 = time.perf_counter()
        self.adapters.set_b(b)
        self.maps = self.calibrator.refit()
        self.recalibrations += 1
        self.recalibration_s += time.perf_counter() - t0

    def alignment(self, b: list[torch.Tensor], it: int) -> None:
        """The diagnostic: the current maps' held-out alignment at adapters ``b``."""
        t0 = time.perf_counter()
        self.adapters.set_b(b)
        per_block = self.calibrator.heldout_alignment(self.maps)
        self.log({"iteration": it, "diagnostic": "heldout_alignment", "alignment": per_block,
                  "median": sorted(per_block)[len(per_block) // 2], "time_s": time.perf_counter() - t0})


@dataclass
class FitState:
    """Everything :func:`fit` needs to continue after a completed iteration: the trajectories,
    the best snapshot so far, the history, and the maps if re-calibration replaced them.

    ``fit(..., on_checkpoint=)`` hands one over after every iteration and ``fit(..., resume=)``
    continues from it to the result an uninterrupted fit gives (on the CPU, bit for bit: every
    statistic is recomputed from the restored B, deterministically). :mod:`loca.method.checkpoint`
    writes and reads it."""

    iteration: int
    frozen_ce: float
    trajectories: list[dict]  # Trajectory fields (b included), stats0 left out
    best: dict  # ce, b, eta, lam_rel, iteration
    history: list[dict]
    a: list[torch.Tensor]
    elapsed_s: float
    recalibrations: int = 0
    recalibration_s: float = 0.0
    maps: FeedbackMaps | None = None  # set once re-calibration replaced the fit's maps


def fit(
    parts: ModelParts,
    maps: FeedbackMaps,
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
    """Fit the adapters forward-only and select (η, λ, iteration) by held-out CE.

    ``cfg`` (default :class:`LocaConfig()`) gives every hyper-parameter; ``calibrator`` is needed
    only for re-calibration and the alignment diagnostic. The best snapshot over all candidates and
    iterations (the frozen model, t = 0, included) is restored in a ``finally`` block: an error, a
    non-finite statistic or an interrupt never leaves a half-updated model (adapters the fit made
    itself are detached again: the model is left frozen). ``on_improve`` is
    called with the adapters set to each new best (e.g. to save it), ``on_iteration`` with each
    history row, ``on_checkpoint`` with a :class:`FitState` after each iteration; ``resume``
    continues from such a state (the same data and ``cfg`` assumed). Pass ``adapters`` to fit
    (and keep a handle on) an existing set (its A is kept); they are reset to B = 0 first.
    """
    cfg = cfg or LocaConfig()
    if not train:
        raise ValueError("the training set is empty")
    if not heldout:
        raise ValueError("the held-out set is empty")
    if maps.fingerprint["num_blocks"] != parts.num_blocks or maps.factors[0].v.shape[0] != parts.hidden_size:
        raise ValueError("the feedback maps do not match this model's blocks")
    if (cfg.recalibrate_every or cfg.alignment_every) and calibrator is None:
        raise ValueError("recalibrate_every and alignment_every need a Calibrator (fit(..., calibrator=))")
    start = time.perf_counter() - (resume.elapsed_s if resume else 0.0)
    created = adapters is None or resume is not None  # detached again if the fit fails
    if resume is not None:
        adapters = ResidualAdapters(parts, rank=cfg.rank, seed=cfg.seed, a=resume.a)
    elif adapters is None:
        a = principal_a(parts, train, cfg.rank, cfg.seed) if cfg.a_init == "principal" else None
        adapters = ResidualAdapters(parts, rank=cfg.rank, seed=cfg.seed, a=a)
    adapters.attach().reset()
    state = _Fit(parts, maps, train, heldout, cfg, adapters, calibrator, on_iteration, start)
    zero = adapters.get_b()
    if resume is None:
        frozen_ce = completion_ce(parts, heldout, state.heldout_graphs).mean
        if not math.isfinite(frozen_ce):
            adapters.detach()
            raise NonFiniteStatisticsError(f"the frozen model's held-out CE is {frozen_ce}")
        state.log({"iteration": 0, "eta": None, "lam_rel": None, "heldout_ce": frozen_ce, "train_ce": None,
                   "b_norm": 0.0})  # fmt: skip
        best = {"ce": frozen_ce, "b": zero, "eta": None, "lam_rel": None, "iteration": 0}
        if cfg.step_control == "fixed":
            trajectories = [Trajectory(eta, lam, zero, frozen_ce) for eta in cfg.etas for lam in cfg.lam_rel]
        else:
            trajectories = [Trajectory(cfg.etas[0], lam, zero, frozen_ce) for lam in cfg.lam_rel]
        first_it = 1
    else:
        frozen_ce, first_it = resume.frozen_ce, resume.iteration + 1
        state.history = [dict(r) for r in resume.history]
        state.recalibrations, state.recalibration_s = resume.recalibrations, resume.recalibration_s
        if resume.maps is not None:
            state.maps = resume.maps
        restored = lambda b: zero if all(not x.any() for x in b) else [x.clone() for x in b]  # noqa: E731
        trajectories = [Trajectory(**{**t, "b": restored(t["b"])}) for t in resume.trajectories]
        best = {**resume.best, "b": restored(resume.best["b"])}

    def consider(traj: Trajectory, eta: float, row: dict, b: list[torch.Tensor]) -> None:
        nonlocal best
        if row["heldout_ce"] < best["ce"]:
            best = {"ce": row["heldout_ce"], "b": b, "eta": eta, "lam_rel": traj.lam_rel,
                    "iteration": row["iteration"]}  # fmt: skip
            if on_improve:
                on_improve(adapters, row)

    def checkpoint(it: int) -> FitState:
        keep = ("eta", "lam_rel", "best_ce", "since_best", "stopped", "accepted")
        return FitState(
            iteration=it, frozen_ce=frozen_ce,
            trajectories=[{**{k: getattr(t, k) for k in keep}, "b": t.b} for t in trajectories],
            best=dict(best), history=list(state.history), a=[x.cpu() for x in adapters.A],
            elapsed_s=time.perf_counter() - start, recalibrations=state.recalibrations,
            recalibration_s=state.recalibration_s, maps=state.maps if state.maps is not maps else None,
        )  # fmt: skip

    shared: dict = {}  # every trajectory starts from B = 0: the first pass's statistics are shared
    bar = tqdm(range(first_it, cfg.max_iters + 1), desc="LoCA", unit="it",
               disable=not progress or not distributed.is_main(),
               initial=first_it - 1, total=cfg.max_iters)  # fmt: skip
    try:
        for it in bar:
            if all(t.stopped for t in trajectories):
                break
            for traj in trajectories:
                if traj.stopped:
                    continue
                if traj.b is zero and traj.stats0 is None and state.maps is maps:
                    traj.stats0 = shared.get("zero")
                t0 = time.perf_counter()
                error = None
                try:
                    train_ce, ce = state.step(traj, traj.eta)
                except NonFiniteStatisticsError as exc:
                    if cfg.step_control == "fixed":
                        traj.stopped = f"non-finite at iteration {it}: {exc}"
                        continue
                    train_ce, ce, error = math.nan, math.inf, str(exc)  # adaptive: a rejected step
                if traj.b is zero and state.maps is maps:
                    shared.setdefault("zero", traj.stats0)
                row = state.row(it, traj, traj.eta, train_ce, ce, t0)
                improved = ce < traj.best_ce
                if cfg.step_control == "adaptive":
                    row["accepted"] = improved
                    if error:
                        row["heldout_ce"], row["train_ce"], row["error"] = None, None, error
                state.log(row)
                if cfg.step_control == "fixed":
                    traj.b, traj.stats0 = adapters.get_b(), None
                    consider(traj, traj.eta, row, traj.b)
                    if improved:
                        traj.best_ce, traj.since_best = ce, 0
                    else:
                        traj.since_best += 1
                elif improved:  # adaptive: accept, grow η, new statistics at the new B next time
                    new_b = adapters.get_b()
                    consider(traj, traj.eta, row, new_b)
                    traj.b, traj.stats0, traj.best_ce, traj.since_best = new_b, None, ce, 0
                    traj.eta *= cfg.eta_grow
                    traj.accepted += 1
                    due = cfg.recalibrate_every and traj.accepted % cfg.recalibrate_every == 0
                    if due and it < cfg.max_iters:
                        state.recalibrate(traj.b)
                        for other in trajectories:
                            other.stats0 = None  # statistics of the old maps
                else:  # adaptive: reject, B stays (restored by the next step's set_b), shrink η
                    traj.eta *= cfg.eta_shrink
                    traj.since_best += 1
                if traj.since_best >= cfg.patience:
                    traj.stopped = f"patience ({cfg.patience}) at iteration {it}"
            if cfg.alignment_every and it % cfg.alignment_every == 0:
                state.alignment(best["b"], it)
            bar.set_postfix(heldout_ce=f"{best['ce']:.4f}", best_it=best["iteration"])
            if on_checkpoint:
                on_checkpoint(checkpoint(it))
    except BaseException:
        if created:  # nobody holds these adapters: leave the model as it was
            adapters.detach()
        raise
    finally:
        bar.close()
        adapters.set_b(best["b"])
    for t in trajectories:
        t.stopped = t.stopped or f"max_iters ({cfg.max_iters})"
    if cfg.step_control == "fixed":
        reasons = {f"eta={t.eta:g},lam_rel={t.lam_rel:g}": t.stopped for t in trajectories}
    else:
        reasons = {f"adaptive,lam_rel={t.lam_rel:g}": t.stopped for t in trajectories}
    return FitResult(
        adapters=adapters,
        frozen_heldout_ce=frozen_ce,
        heldout_ce=best["ce"],
        eta=best["eta"],
        lam_rel=best["lam_rel"],
        best_iteration=best["iteration"],
        improved=best["iteration"] > 0,
        history=state.history,
        stop_reasons=reasons,
        wall_time_s=time.perf_counter() - start,
        recalibrations=state.recalibrations,
        recalibration_time_s=state.recalibration_s,
        graph_capture_s=sum(g.capture_s for g in (state.train_graphs, state.heldout_graphs) if g is not None),
    )
