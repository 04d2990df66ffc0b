"""MeZO baselines (Malladi et al. 2023): zeroth-order SPSA with seeded, regenerated noise.

Step t of a candidate (lr, ε) on minibatch b_t, with z ~ N(0, I) drawn per tensor from a generator
seeded by (seed, t, tensor index) and never stored::

    g = (L(θ + εz; b_t) − L(θ − εz; b_t)) / 2ε        # ≈ ⟨∇L, z⟩, two inference forwards
    θ ← θ − (lr / √D) · g · z                           # D = number of perturbed parameters

After the ±ε pair θ is copied back from a backup, so it is bit-identical to before (adding and
subtracting εz in floating point is not exact). Adapter-MeZO perturbs the B matrices of LoCA's own
:class:`~loca.method.adapters.ResidualAdapters` (A fixed); full MeZO perturbs every weight of the model.
Both are selected like every method of the comparison (:class:`~.common.HeldoutSelector`).

Why the default learning rates (``lr`` is given *before* the 1/√D scaling; ``η = lr/√D``): to
second order a step changes the minibatch loss by ``−η g² + ½ η² g² zᵀHz``, and ``zᵀHz ≈ tr H`` for
a random z, so it descends for ``η < 2/tr H`` (the edge) and fastest near ``η* = 1/tr H`` (SGD's
``1/λ_max`` with the trace in place of the top eigenvalue). In expectation ``−η g z`` is an SGD step
of size η; ``‖η g z‖ ≈ lr·|g|``, so lr is the step's norm relative to the gradient's, and the
optimum is ``lr* = √D/tr H``. tr H was measured along random z (``(L₊ + L₋ − 2L)/ε²``) for the
adapters and for all weights of SmolLM2-135M-Instruct, and the resulting lr* checked by short runs;
the numbers are in docs/compare.md ("MeZO's default learning rates").

Each default grid spans 0.1–1 × that optimum in half-decades and stays below the edge, since the
curvature grows as the fit moves and differs between tasks. The adapters' B acts on the
un-normalised residual stream, whose norm is large, so its per-coordinate curvature is far above
the weights': one grid cannot serve both, hence a default per method (``MezoSettings.lrs = None``).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..config import Settings, option, positive_finite
from ..data.batching import Batch
from ..infra import distributed
from ..method.adapters import ResidualAdapters
from ..models.parts import ModelParts
from .common import HeldoutSelector, MethodResult, RestorableRun, completion_loss

ADAPTER_LRS = (1e-3, 3e-3, 1e-2)  # × 1/√D; see the module docstring
FULL_LRS = (3e-2, 1e-1, 3e-1)


@dataclass(frozen=True)
class MezoSettings(Settings):
    """Hyper-parameters of Adapter-MeZO and full MeZO."""

    lrs: list[float] | None = option(
        None,
        "learning-rate candidates before the 1/sqrt(D) scaling (D = perturbed parameters); the "
        f"step is lr/sqrt(D)·g·z. None: {list(ADAPTER_LRS)} for adapters, {list(FULL_LRS)} for all "
        "weights (0.1–1 × the 1/tr(H) optimum measured on SmolLM2-135M; see loca.baselines.mezo)",
    )
    eps: list[float] = option([1e-3], "perturbation scale ε candidates (z ~ N(0, I))")
    max_steps: int = option(2000, "SPSA steps per candidate (two forward passes each)")
    time_budget_s: float | None = option(
        None, "wall-time budget of the whole method, split equally between candidates; None: no limit"
    )
    eval_every: int = option(100, "held-out CE every this many steps (and at each candidate's end)")
    seed: int = option(0, "seed of the noise z, the minibatch order and (adapter-MeZO) A")
    rank: int = option(32, "adapter rank r (adapter-MeZO only)")

    def checks(self) -> dict[str, bool]:
        return {
            "lrs": self.lrs is None or positive_finite(self.lrs),
            "eps": positive_finite(self.eps),
            "max_steps": self.max_steps >= 1,
            "time_budget_s": self.time_budget_s is None or self.time_budget_s > 0,
            "eval_every": self.eval_every >= 1,
            "rank": self.rank >= 1,
        }

    def candidates(self, default_lrs: Sequence[float]) -> list[dict]:
        """``{"lr", "eps"}`` for every pair, learning rate first."""
        return [{"lr": lr, "eps": e} for lr in (self.lrs or default_lrs) for e in self.eps]


def derived_seed(*key: object) -> int:
    """A 63-bit generator seed from a key, e.g. ``("z", seed, step, tensor_index)``."""
    digest = hashlib.blake2b(":".join(map(str, ("loca-mezo", *key))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Spsa:
    """The SPSA core: seeded in-place perturbation of a list of tensors and an exact restore.

    ``backup="device"`` keeps the copy for the restore next to the tensors (right for small ones:
    the adapters' B); ``"host"`` keeps it in CPU memory, pinned when the tensors are on a GPU, so a
    full-model MeZO costs one model of host RAM (and two transfers per step) instead of a second
    model of GPU memory. On a CPU model the two are the same: one extra copy in RAM.
    """

    def __init__(self, tensors: Sequence[Tensor], seed: int = 0, backup: str = "device"):
        if backup not in ("device", "host"):
            raise ValueError(f"backup must be 'device' or 'host', not {backup!r}")
        self.tensors, self.seed = list(tensors), seed
        self._gens: dict[torch.device, torch.Generator] = {}
        if backup == "device":
            self._backup = [torch.empty_like(t) for t in self.tensors]
        else:
            self._backup = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda) for t in self.tensors
            ]

    @property
    def n_params(self) -> int:
        return sum(t.numel() for t in self.tensors)

    def noise(self, step: int, index: int) -> Tensor:
        """z for tensor ``index`` at ``step``: N(0, I), the tensor's shape, dtype and device."""
        t = self.tensors[index]
        gen = self._gens.get(t.device)
        if gen is None:
            gen = self._gens[t.device] = torch.Generator(device=t.device)
        gen.manual_seed(derived_seed("z", self.seed, step, index))
        return torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device)

    @torch.no_grad()
    def perturb(self, step: int, scale: float) -> None:
        """θ ← θ + scale · z(step), tensor by tensor (one tensor's noise in memory at a time)."""
        for i, t in enumerate(self.tensors):
            t.add_(self.noise(step, i), alpha=scale)

    @torch.no_grad()
    def save(self) -> None:
        for b, t in zip(self._backup, self.tensors, strict=True):
            b.copy_(t, non_blocking=True)  # same stream as the restore: ordered without a sync

    @torch.no_grad()
    def restore(self) -> None:
        for b, t in zip(self._backup, self.tensors, strict=True):
            t.copy_(b, non_blocking=True)

    def loss_pair(self, loss_fn: Callable[[], Tensor], step: int, eps: float) -> tuple[float, float]:
        """``(L(θ + εz), L(θ − εz))``; θ is bit-identical afterwards, even after an exception."""
        self.save()
        try:
            self.perturb(step, eps)
            plus = loss_fn()
            self.perturb(step, -2.0 * eps)
            minus = loss_fn()
        finally:
            self.restore()
        lp, lm = torch.stack((plus.detach(), minus.detach())).tolist()  # one host sync
        return lp, lm

    def step(
        self, loss_fn: Callable[[], Tensor], step: int, eps: float, lr_scaled: float
    ) -> tuple[float, float]:
        """One SPSA step; returns the loss pair. Non-finite losses leave θ as it was."""
        lp, lm = self.loss_pair(loss_fn, step, eps)
        if math.isfinite(lp) and math.isfinite(lm):
            self.perturb(step, -lr_scaled * spsa_gradient(lp, lm, eps))
        return lp, lm


def spsa_gradient(loss_plus: float, loss_minus: float, eps: float) -> float:
    """The projected gradient ``(L₊ − L₋)/2ε`` ≈ ⟨∇L, z⟩."""
    return (loss_plus - loss_minus) / (2.0 * eps)


class MezoRun(RestorableRun):
    """What a MeZO fit returns: the result, with the model left in the selected state.

    Evaluate first, then call :meth:`restore` (or use the run as a context manager): it detaches
    the adapters (adapter-MeZO; the model is bit-identical to before) or copies the original
    weights back bit-exactly (full MeZO). ``adapters`` is None for full MeZO.
    """


def fit_adapter_mezo(
    parts: ModelParts,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    settings: MezoSettings | None = None,
    *,
    adapters: ResidualAdapters | None = None,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> MezoRun:
    """Adapter-MeZO: SPSA on the B matrices of ``ResidualAdapters(parts, settings.rank, settings.seed)``.

    Pass ``adapters`` to use (and keep a handle on) an existing set; it is reset to B = 0 first.
    Returns with the adapters attached at the selected B (B = 0 when the frozen model won);
    ``run.restore()`` detaches them. If the fit raises, adapters created here are detached.
    """
    settings = settings or MezoSettings()
    own = adapters is None
    if adapters is None:
        adapters = ResidualAdapters(parts, rank=settings.rank, seed=settings.seed)
    adapters.attach().reset()
    spsa = Spsa(adapters.B, seed=settings.seed, backup="device")

    @torch.no_grad()
    def put_b(state: list[Tensor]) -> None:  # in place: Spsa holds these very tensors
        for b, s in zip(spsa.tensors, state, strict=True):
            b.copy_(s)

    try:
        result = _fit(
            "adapter_mezo",
            parts,
            train,
            heldout,
            settings,
            spsa,
            ADAPTER_LRS,
            reset=adapters.reset,
            snapshot=adapters.get_b,
            restore=put_b,
            progress=progress,
            on_row=on_row,
        )
    except BaseException:
        if own:
            adapters.detach()
        raise
    return MezoRun(result, adapters, adapters.detach)


def fit_mezo(
    parts: ModelParts,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    settings: MezoSettings | None = None,
    *,
    backup: str = "host",
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> MezoRun:
    """Full MeZO: SPSA on every floating-point weight of the model, in place.

    Returns with the model at the selected weights; ``run.restore()`` copies the original ones
    back bit-exactly. If the fit raises, the original weights are put back before it propagates.

    Host memory: the original weights, the best snapshot (taken only when held-out CE improves;
    the frozen state shares the original's copy; briefly two while a new best replaces the old)
    and, with ``backup="host"``, the per-step copy for the exact restore: up to three models'
    worth (four on a CPU model, counting the model itself). GPU memory then stays at inference
    level, at the price of copying the weights to the host and back at every step;
    ``backup="device"`` keeps that copy on the GPU instead, trading GPU memory for step time
    (docs/compare.md has the cost of each). Both give identical results.
    """
    settings = settings or MezoSettings()
    params = [p for p in parts.model.parameters() if p.is_floating_point()]
    spsa = Spsa(params, seed=settings.seed, backup=backup)
    original = [p.detach().to("cpu", copy=True) for p in params]
    frozen_pending = [True]  # HeldoutSelector snapshots the frozen model first: it shares ``original``

    @torch.no_grad()
    def put(state: list[Tensor]) -> None:
        for p, s in zip(params, state, strict=True):
            p.copy_(s)

    def snapshot() -> list[Tensor]:
        if frozen_pending[0]:
            frozen_pending[0] = False
            return original
        return [p.detach().to("cpu", copy=True) for p in params]

    try:
        result = _fit(
            "mezo",
            parts,
            train,
            heldout,
            settings,
            spsa,
            FULL_LRS,
            reset=lambda: put(original),
            snapshot=snapshot,
            restore=put,
            progress=progress,
            on_row=on_row,
        )
    except BaseException:
        put(original)
        raise
    return MezoRun(result, None, lambda: put(original))


def _fit(
    method: str,
    parts: ModelParts,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    settings: MezoSettings,
    spsa: Spsa,
    default_lrs: Sequence[float],
    *,
    reset: Callable[[], None],
    snapshot: Callable[[], object],
    restore: Callable[[object], None],
    progress: bool,
    on_row: Callable[[dict], None] | None,
) -> MethodResult:
    """The candidate loop shared by both methods; leaves the best state in place (``finally``)."""
    if not train:
        raise ValueError("the training set is empty")
    train = [b.to(parts.device) for b in train]  # once, not twice per step
    lrs = list(settings.lrs or default_lrs)
    cands = settings.candidates(lrs)
    n_params = spsa.n_params
    share = None if settings.time_budget_s is None else settings.time_budget_s / len(cands)
    orders: dict[int, list[int]] = {}

    def batch_at(step: int) -> Batch:  # steps are 1-based; a seeded shuffle per pass
        epoch, i = divmod(step - 1, len(train))
        if epoch not in orders:
            gen = torch.Generator().manual_seed(derived_seed("order", settings.seed, epoch))
            orders[epoch] = torch.randperm(len(train), generator=gen).tolist()
        return train[orders[epoch][i]]

    def loss_fn(batch: Batch) -> Callable[[], Tensor]:
        def run() -> Tensor:
            with torch.inference_mode():
                return completion_loss(parts, batch)

        return run

    stop_reasons: dict[str, str] = {}
    steps_done: dict[str, int] = {}
    time_s: dict[str, float] = {}
    selector = HeldoutSelector(parts, heldout, snapshot, restore, on_row)
    bar = tqdm(total=len(cands) * settings.max_steps, desc=method, unit="step", disable=not progress)
    try:
        selector.evaluate(None, 0, train_loss=None)
        for cand in cands:
            label = f"lr={cand['lr']:g},eps={cand['eps']:g}"
            lr_scaled, eps = cand["lr"] / math.sqrt(n_params), cand["eps"]
            reset()
            start = time.perf_counter()
            losses: list[float] = []
            done = last_eval = 0
            reason = f"max_steps ({settings.max_steps})"
            for t in range(1, settings.max_steps + 1):
                lp, lm = spsa.step(loss_fn(batch_at(t)), t, eps, lr_scaled)
                if not (math.isfinite(lp) and math.isfinite(lm)):
                    reason = f"non-finite training loss at step {t}"
                    break
                done = t
                losses.append(0.5 * (lp + lm))
                bar.update()
                if t % settings.eval_every == 0:
                    ce = selector.evaluate(cand, t, train_loss=sum(losses) / len(losses))
                    losses, last_eval = [], t
                    bar.set_postfix(lr=cand["lr"], heldout_ce=f"{selector.best_ce:.4f}")
                    if not math.isfinite(ce):
                        reason = f"non-finite held-out CE at step {t}"
                        break
                over = share is not None and time.perf_counter() - start >= share
                if share is not None and t < settings.max_steps and distributed.from_main(float(over)):
                    reason = f"time budget ({share:.3g} s per candidate) after step {t}"
                    break
            if done > last_eval:
                selector.evaluate(cand, done, train_loss=sum(losses) / len(losses))
            stop_reasons[label], steps_done[label] = reason, done
            time_s[label] = time.perf_counter() - start
    finally:
        bar.close()
        selector.restore_best()
    return selector.result(
        method,
        "step",
        n_params=n_params,
        lrs=lrs,
        lrs_scaled=[lr / math.sqrt(n_params) for lr in lrs],
        stop_reasons=stop_reasons,
        steps_done=steps_done,
        candidate_time_s=time_s,
        settings=settings.to_dict(),
    )
