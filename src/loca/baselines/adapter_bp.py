"""Adapter-BP: LoCA's own residual adapters with B trained by backpropagation (the ceiling).

The adapters are :class:`~loca.method.adapters.ResidualAdapters` (``h_l += B_l A_l h_{l-1}``, A fixed
from the seed as LoCA's, B from 0); B is trained with AdamW on the exact gradient of the
completion loss (:func:`~.common.completion_loss`), over the comparison's minibatches, and
selected by held-out CE like every method (:class:`~.common.HeldoutSelector`). Whatever credit
assignment LoCA uses, it fits these same B matrices, so the best held-out CE reachable by their
true gradient is the ceiling LoCA's forward-only fit can be measured against (``R_ceiling``).

``credit="predict"`` trains each B_l only on the gradient of block l's output *at the predict
positions*: the correction ``B_l A_l h`` is added at every position in the forward, as always,
but its backward contribution to B_l is ``Σ_{t ∈ predict} g_l[t] p_l[t]ᵀ`` (``g_l = ∂L/∂h_l``,
``p_l = A_l h_{l-1}``) instead of the sum over all positions. LoCA's statistics are recorded at
the predict positions only, so this is the ceiling of any credit assignment that, like LoCA,
sees each block there alone. The gradient flowing on to earlier blocks is not masked.

Training forwards run through hooks of this module (the correction with autograd); held-out
evaluation and the returned model run through the adapters' own hooks, exactly as LoCA's fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..config import A_INITS, Settings, option, positive_finite
from ..data.batching import Batch
from ..method.a_init import principal_a
from ..method.adapters import ResidualAdapters
from ..models.parts import ModelParts
from .common import HeldoutSelector, RestorableRun, completion_loss, epoch_order

CREDITS = {
    "all": "the exact gradient (every position)",
    "predict": "only block output gradients at the predict positions (LoCA's view)",
}


@dataclass(frozen=True)
class AdapterBpSettings(Settings):
    """Hyper-parameters of Adapter-BP."""

    lrs: list[float] = option([1e-4, 3e-4], "AdamW learning-rate candidates, selected by held-out CE")
    epochs: int = option(3, "passes over the training minibatches per learning rate")
    eval_every: int = option(16, "held-out CE every N optimizer steps (and at each candidate's end)")
    weight_decay: float = option(0.0, "AdamW weight decay of B")
    grad_clip: float = option(1.0, "clip the gradient's global norm (over all B) to this; 0 = no clipping")
    credit: str = option("all", "which gradient reaches each block's B", choices=CREDITS)
    rank: int = option(32, "adapter rank r (LoCA's)")
    a_init: str = option("random", "the fixed A, as LoCA's a_init", choices=A_INITS)
    seed: int = option(0, "seed of A (LoCA's for this seed) and of the minibatch order")

    def checks(self) -> dict[str, bool]:
        return {
            "lrs": positive_finite(self.lrs),
            "epochs": self.epochs >= 1,
            "eval_every": self.eval_every >= 1,
            "weight_decay": self.weight_decay >= 0,
            "grad_clip": self.grad_clip >= 0,
            "rank": self.rank >= 1,
            "seed": self.seed >= 0,
        }


class _PredictCredit(torch.autograd.Function):
    """``h_out + p @ bt`` whose gradient w.r.t. ``bt`` keeps only the rows ``rows`` of the output
    gradient (the predict positions); the gradients w.r.t. ``h_out`` and ``p`` are the exact ones."""

    @staticmethod
    def forward(ctx, h_out: Tensor, p: Tensor, bt: Tensor, rows: Tensor) -> Tensor:
        ctx.save_for_backward(p, bt, rows)
        return torch.addmm(h_out, p, bt)

    @staticmethod
    def backward(ctx, g: Tensor):
        p, bt, rows = ctx.saved_tensors
        grad_p = g @ bt.T if ctx.needs_input_grad[1] else None
        grad_bt = p.index_select(0, rows).T @ g.index_select(0, rows) if ctx.needs_input_grad[2] else None
        return g, grad_p, grad_bt, None


class BackpropAdapters:
    """The B matrices of ``adapters`` as float32 leaves that require grad, applied to the model by
    training hooks; :meth:`loss_and_grads` is one forward and backward on a batch."""

    def __init__(self, adapters: ResidualAdapters, credit: str = "all"):
        if credit not in CREDITS:
            raise ValueError(f"credit must be one of {tuple(CREDITS)}, not {credit!r}")
        self.adapters, self.parts, self.credit = adapters, adapters.parts, credit
        self.params = [b.detach().clone().requires_grad_(True) for b in adapters.B]
        self._rows: dict[torch.device, Tensor] = {}

    def load(self, bs: Sequence[Tensor]) -> None:
        with torch.no_grad():
            for p, b in zip(self.params, bs, strict=True):
                p.copy_(b)

    def push(self) -> None:
        """Copy the trained B into the adapters (their hooks then apply it)."""
        self.adapters.set_b([p.detach() for p in self.params])

    def _hook(self, layer: int):
        a, b = self.adapters.A[layer], self.params[layer]

        def hook(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = output[0] if isinstance(output, tuple) else output
            if h_in.device != h_out.device:
                h_in = h_in.to(h_out.device)
            d, dtype = h_out.shape[-1], h_in.dtype  # the same casts as ResidualAdapters' hook
            p = (h_in @ a.T.to(dtype)).reshape(-1, a.shape[0])
            bt = b.T.to(dtype)
            if self.credit == "predict":
                rows = self._rows.get(h_out.device)
                if rows is None:
                    rows = self._rows[h_out.device] = next(iter(self._rows.values())).to(h_out.device)
                h_new = _PredictCredit.apply(h_out.reshape(-1, d), p, bt, rows)
            else:
                h_new = torch.addmm(h_out.reshape(-1, d), p, bt)
            h_new = h_new.view(h_out.shape)
            return (h_new, *output[1:]) if isinstance(output, tuple) else h_new

        return hook

    def loss_and_grads(self, batch: Batch) -> tuple[Tensor, list[Tensor]]:
        """The completion loss on ``batch`` and its gradient w.r.t. every B (per ``credit``).

        The adapters' own hooks must be detached. Gradients are taken w.r.t. B alone
        (``torch.autograd.grad``): nothing else receives a ``.grad``."""
        if self.adapters.attached:
            raise RuntimeError("detach the adapters' own hooks before a training step")
        b = batch.to(self.parts.device)
        flat = b.pos_b * b.input_ids.shape[1] + b.pos_t  # rows of the flattened B·T positions
        self._rows = {flat.device: flat}
        handles = [
            blk.register_forward_hook(self._hook(l), with_kwargs=True)
            for l, blk in enumerate(self.parts.blocks)
        ]
        try:
            with torch.enable_grad():
                loss = completion_loss(self.parts, b)
                grads = torch.autograd.grad(loss, self.params)
        finally:
            for h in handles:
                h.remove()
            self._rows = {}
        return loss.detach(), list(grads)


class AdapterBpRun(RestorableRun):
    """What :func:`fit_adapter_bp` returns: the result, with the adapters attached at the selected
    B. :meth:`restore` (or leaving a ``with`` block) detaches them: the model is as before."""


def fit_adapter_bp(
    parts: ModelParts,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    settings: AdapterBpSettings | None = None,
    *,
    adapters: ResidualAdapters | None = None,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> AdapterBpRun:
    """Train B of ``ResidualAdapters(parts, settings.rank, settings.seed)`` by AdamW for every
    learning rate from B = 0 and keep the best held-out state (the frozen model included).

    Each candidate runs ``epochs`` passes over ``train`` in the seeded order LoRA uses; the
    held-out CE is measured first on the frozen model (step 0), then every ``eval_every`` steps
    and at the candidate's end. A non-finite training loss or held-out CE stops a candidate.
    ``adapters``: an existing set to train (e.g. LoCA's principal A, which LoCA computes on its own
    batches; ``a_init="principal"`` computes it here on ``train``); it is reset to B = 0. The
    model's parameters are frozen (``requires_grad=False``) during the fit and get their flags
    back after it. Returns with the adapters attached at the selected B; if the fit raises,
    adapters created here are detached.
    """
    settings = settings or AdapterBpSettings()
    if not train:
        raise ValueError("the training set is empty")
    own = adapters is None
    if adapters is None:
        principal = settings.a_init == "principal"
        a = principal_a(parts, train, settings.rank, settings.seed) if principal else None
        adapters = ResidualAdapters(parts, rank=settings.rank, seed=settings.seed, a=a)
    adapters.detach()
    adapters.reset()
    trainer = BackpropAdapters(adapters, settings.credit)
    zeros = [torch.zeros_like(p) for p in trainer.params]
    was_training = parts.model.training
    flags = {n: p.requires_grad for n, p in parts.model.named_parameters()}
    selector = HeldoutSelector(parts, heldout, snapshot=adapters.get_b, restore=adapters.set_b, on_row=on_row)
    stop_reasons: dict[str, str] = {}
    steps_done: dict[str, int] = {}
    bar = tqdm(
        total=len(settings.lrs) * settings.epochs * len(train),
        desc="Adapter-BP",
        unit="step",
        disable=not progress,
    )

    def evaluate(candidate: dict | None, step: int, **extra) -> float:
        trainer.push()
        adapters.attach()
        try:
            return selector.evaluate(candidate, step, **extra)
        finally:
            adapters.detach()

    try:
        parts.model.requires_grad_(False)
        parts.model.eval()
        try:
            evaluate(None, 0, epoch=0, train_loss=None)
            for lr in settings.lrs:
                label = f"lr={lr:g}"
                trainer.load(zeros)
                stop_reasons[label], steps_done[label] = _train_candidate(
                    trainer, lr, train, settings, evaluate, selector, bar
                )
        finally:
            for n, p in parts.model.named_parameters():
                p.requires_grad_(flags[n])
            parts.model.train(was_training)
            bar.close()
            selector.restore_best()
            adapters.attach()
    except BaseException:
        if own:
            adapters.detach()
        raise
    result = selector.result(
        "adapter_bp",
        "step",
        n_trainable_params=sum(p.numel() for p in trainer.params),
        stop_reasons=stop_reasons,
        steps_done=steps_done,
        credit=settings.credit,
        settings=settings.to_dict(),
    )
    return AdapterBpRun(result, adapters, adapters.detach)


def _train_candidate(
    trainer: BackpropAdapters,
    lr: float,
    train: Sequence[Batch],
    s: AdapterBpSettings,
    evaluate: Callable[..., float],
    selector: HeldoutSelector,
    bar,
) -> tuple[str, int]:
    """One learning rate from B = 0; returns why it stopped and its number of steps."""
    params = trainer.params
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=s.weight_decay)
    candidate = {"lr": lr}
    losses: list[Tensor] = []  # since the last evaluation; checked there (no host sync per step)
    step = 0

    def check(epoch: int) -> str | None:
        train_loss = float(torch.stack(losses).double().mean())
        losses.clear()
        ce = evaluate(candidate, step, epoch=epoch, train_loss=train_loss)
        bar.set_postfix(lr=f"{lr:g}", heldout_ce=f"{ce:.4f}", best=f"{selector.best_ce:.4f}")
        if not math.isfinite(train_loss):
            return f"non-finite training loss before step {step}"
        if not math.isfinite(ce):
            return f"non-finite held-out CE at step {step}"
        return None

    for epoch in range(1, s.epochs + 1):
        for i in epoch_order(s.seed, epoch, len(train)):
            loss, grads = trainer.loss_and_grads(train[i])
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            if s.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
            step += 1
            bar.update()
            if step % s.eval_every == 0 and (reason := check(epoch)):
                return reason, step
    if losses and (reason := check(s.epochs)):
        return reason, step
    return f"completed {s.epochs} epochs ({step} steps)", step
