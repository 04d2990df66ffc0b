"""Stage II: forward-only fitting of the residual adapters with closed-form ridge solves.

Each outer iteration is one inference-mode forward pass over the training data per Gauss–Seidel
group (one pass in total for the default Jacobi schedule). During the pass every block records
``p = A h_{l-1}`` at the predict positions; after it, the head error ``e`` gives the local targets
through the feedback maps. Only ``G = Σ p pᵀ`` (r×r) and ``Σ s·Y P`` (k×r) persist per block.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .adapters import Recorder, ResidualAdapters
from .calibrate import FeedbackMaps
from .data.batching import Batch
from .head import head_loss_and_error
from .metrics import TokenCE, completion_ce
from .models import ModelParts
from .ridge import BlockStats, NonFiniteStatisticsError, solve_block

STEP_SCALES = ("rms", "absolute")


def block_groups(num_blocks: int, groups: int) -> list[list[int]]:
    """Split blocks 0..L-1 into ``groups`` contiguous, near-equal groups (input side first)."""
    groups = min(groups, num_blocks)
    bounds = [round(i * num_blocks / groups) for i in range(groups + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(groups)]


@torch.inference_mode()
def collect_statistics(
    parts: ModelParts,
    adapters: ResidualAdapters,
    maps: FeedbackMaps,
    batches: Sequence[Batch],
    blocks: Sequence[int],
    step_scale: str = "rms",
) -> tuple[dict[int, BlockStats], TokenCE]:
    """One forward pass: per-block statistics for ``blocks`` and the training CE before the update.

    The hooks keep only the codes p (N×r) and an input norm per block; the statistics of all
    blocks on a device are then updated as one stack (a few batched kernels per batch), and
    nothing is copied to the host inside the loop, so a GPU never waits on Python.
    """
    by_device: dict[torch.device, list[int]] = {}
    for l in blocks:
        by_device.setdefault(adapters.devices[l], []).append(l)
    k = maps.rank
    stacks = {
        dev: (
            BlockStats.zeros(adapters.rank, k, dev, blocks=len(ls)),
            torch.cat([maps.factors[l].v for l in ls], dim=1),  # d × (L·k): all V_k side by side
            torch.stack([maps.sigma(l) for l in ls]),  # L × k
        )
        for dev, ls in by_device.items()
    }
    losses, eos = [], []
    for batch in batches:
        b = batch.to(parts.device)
        with adapters.recording(Recorder(b.pos_b, b.pos_t, set(blocks))) as rec:
            hn = parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t)
        loss, e = head_loss_and_error(hn, parts.head.weight, parts.head.bias, b.targets, parts.transform)
        losses.append(loss)
        eos.append(b.is_eos)
        for dev, ls in by_device.items():
            stats, v_all, sigma = stacks[dev]
            p = torch.stack([rec.codes[l] for l in ls])  # L × N × r
            h_sumsq = torch.stack([rec.input_norms[l] for l in ls]).square()
            e_dev = e.to(dev)
            y = (e_dev @ v_all.to(e_dev.dtype)).view(-1, len(ls), k).transpose(0, 1)  # L × N × k
            stats.add_inputs(p)
            stats.add_targets(p, h_sumsq, y, sigma, normalize=step_scale == "rms")
    ce = TokenCE()
    ce.add(torch.cat(losses), torch.cat(eos))
    out = {}
    for dev, ls in by_device.items():
        for i, l in enumerate(ls):
            out[l] = stacks[dev][0][i]
    return out, ce


@dataclass
class Trajectory:
    """One (η, λ) candidate's state."""

    eta: float
    lam_rel: float
    b: list[torch.Tensor]
    best_ce: float
    since_best: int = 0
    stopped: str | None = None


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
        }


def fit(
    parts: ModelParts,
    maps: FeedbackMaps,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    *,
    rank: int = 32,
    seed: int = 0,
    etas: Sequence[float] = (0.003, 0.01, 0.03),
    lam_rels: Sequence[float] = (1e-3,),
    max_iters: int = 40,
    patience: int = 3,
    groups: int = 1,
    step_scale: str = "rms",
    on_iteration: Callable[[dict], None] | None = None,
    on_improve: Callable[[ResidualAdapters, dict], None] | None = None,
    adapters: ResidualAdapters | None = None,
    progress: bool = True,
) -> FitResult:
    """Fit the adapters forward-only and select (η, λ, iteration) by held-out CE.

    Every (η, λ) candidate runs its own trajectory; all start from B = 0, so the statistics of their
    first pass are shared. The best snapshot over all candidates and iterations (the frozen model,
    t = 0, included) is restored in a ``finally`` block: an error, a non-finite statistic or an
    interrupt never leaves a half-updated model. ``on_improve`` is called with the adapters set to
    each new best (e.g. to save it), ``on_iteration`` with each history row. Pass ``adapters`` to
    fit (and keep a handle on) an existing set; they are reset to B = 0 first. ``step_scale``
    "rms" makes η a relative step (scaled per block and batch by RMS(h)/RMS(F e)); "absolute" uses
    η as an absolute step (the paper's unnormalised ablation).
    """
    if step_scale not in STEP_SCALES:
        raise ValueError(f"step_scale must be one of {STEP_SCALES}, got {step_scale!r}")
    if not train:
        raise ValueError("the training set is empty")
    if not heldout:
        raise ValueError("the held-out set is empty")
    if maps.fingerprint["num_blocks"] != parts.num_blocks or maps.factors[0].v.shape[0] != parts.hidden_size:
        raise ValueError("the feedback maps do not match this model's blocks")
    start = time.perf_counter()
    if adapters is None:
        adapters = ResidualAdapters(parts, rank=rank, seed=seed)
    adapters.attach().reset()
    zero = adapters.get_b()
    group_list = block_groups(parts.num_blocks, groups)
    history: list[dict] = []

    def log(row: dict) -> None:
        row["elapsed_s"] = time.perf_counter() - start
        history.append(row)
        if on_iteration:
            on_iteration(row)

    frozen_ce = completion_ce(parts, heldout).mean
    if not math.isfinite(frozen_ce):
        adapters.detach()
        raise NonFiniteStatisticsError(f"the frozen model's held-out CE is {frozen_ce}")
    log(
        {
            "iteration": 0,
            "eta": None,
            "lam_rel": None,
            "heldout_ce": frozen_ce,
            "train_ce": None,
            "b_norm": 0.0,
        }
    )
    best = {"ce": frozen_ce, "b": zero, "eta": None, "lam_rel": None, "iteration": 0}
    trajectories = [Trajectory(eta, lam, zero, frozen_ce) for eta in etas for lam in lam_rels]
    shared: tuple[dict[int, BlockStats], TokenCE] | None = None
    bar = tqdm(range(1, max_iters + 1), desc="LoCA", unit="it", disable=not progress)
    try:
        for it in bar:
            for traj in trajectories:
                if traj.stopped:
                    continue
                t0 = time.perf_counter()
                adapters.set_b(traj.b)
                train_ce = None
                try:
                    for gi, blocks in enumerate(group_list):
                        if it == 1 and gi == 0:  # every trajectory starts from B = 0: share the pass
                            shared = shared or collect_statistics(
                                parts, adapters, maps, train, blocks, step_scale
                            )
                            stats, ce = shared
                        else:
                            stats, ce = collect_statistics(parts, adapters, maps, train, blocks, step_scale)
                        if gi == 0:
                            train_ce = ce.mean
                        for l in blocks:
                            us = maps.factors[l].us
                            adapters.B[l] = solve_block(adapters.B[l], stats[l], us, traj.eta, traj.lam_rel)
                    ce_now = completion_ce(parts, heldout).mean
                    if not math.isfinite(ce_now):
                        raise NonFiniteStatisticsError(f"held-out CE became {ce_now}")
                except NonFiniteStatisticsError as exc:
                    traj.stopped = f"non-finite at iteration {it}: {exc}"
                    continue
                traj.b = adapters.get_b()
                row = {
                    "iteration": it,
                    "eta": traj.eta,
                    "lam_rel": traj.lam_rel,
                    "heldout_ce": ce_now,
                    "train_ce": train_ce,
                    "b_norm": adapters.norm(),
                    "time_s": time.perf_counter() - t0,
                }
                log(row)
                if ce_now < traj.best_ce:
                    traj.best_ce, traj.since_best = ce_now, 0
                else:
                    traj.since_best += 1
                    if traj.since_best >= patience:
                        traj.stopped = f"patience ({patience}) at iteration {it}"
                if ce_now < best["ce"]:
                    best = {
                        "ce": ce_now,
                        "b": traj.b,
                        "eta": traj.eta,
                        "lam_rel": traj.lam_rel,
                        "iteration": it,
                    }
                    if on_improve:
                        on_improve(adapters, row)
            bar.set_postfix(heldout_ce=f"{best['ce']:.4f}", best_it=best["iteration"])
            if all(t.stopped for t in trajectories):
                break
    finally:
        bar.close()
        adapters.set_b(best["b"])
    for t in trajectories:
        t.stopped = t.stopped or f"max_iters ({max_iters})"
    return FitResult(
        adapters=adapters,
        frozen_heldout_ce=frozen_ce,
        heldout_ce=best["ce"],
        eta=best["eta"],
        lam_rel=best["lam_rel"],
        best_iteration=best["iteration"],
        improved=best["iteration"] > 0,
        history=history,
        stop_reasons={f"eta={t.eta:g},lam_rel={t.lam_rel:g}": t.stopped for t in trajectories},
        wall_time_s=time.perf_counter() - start,
    )
