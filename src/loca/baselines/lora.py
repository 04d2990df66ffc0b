"""The LoRA baseline: backpropagation through the frozen model into PEFT LoRA layers.

LoRA trains on the same batches as LoCA with the same loss (:func:`~.common.completion_loss`) and
is selected by the same held-out CE (:class:`~.common.HeldoutSelector`) over learning rates and
epochs, the frozen model included (``select=False``: the paper's protocol, the last iterate of
one learning rate, no selection). The LoRA layers are injected into ``parts.blocks`` in place
(``peft.inject_adapter_in_model``), so ``parts.backbone``, ``parts.blocks`` and
``parts.final_hidden`` keep working and run through them; :meth:`LoraRun.unload` puts the
original modules back. ``peft`` is imported only when a fit starts (the ``baselines`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..config import Settings, option, positive_finite
from ..data.batching import Batch
from ..models.parts import ModelParts
from .common import HeldoutSelector, MethodResult, completion_loss, epoch_order

ADAPTER_NAME = "default"


@dataclass(frozen=True)
class LoraSettings(Settings):
    """Hyper-parameters of the LoRA baseline."""

    rank: int = option(32, "LoRA rank r")
    alpha: float = option(64, "LoRA alpha; the update is scaled by alpha / r")
    dropout: float = option(0.0, "dropout on the LoRA input (the model trains in train mode only when > 0)")
    target_modules: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "names of the block linear layers that get LoRA"
    )
    lrs: list[float] = option([2e-4, 1e-3], "AdamW learning-rate candidates, selected by held-out CE")
    epochs: int = option(3, "passes over the training batches per learning rate")
    eval_every: int = option(0, "held-out CE every N optimizer steps; 0 = after every epoch")
    weight_decay: float = option(0.0, "AdamW weight decay of the LoRA parameters")
    grad_clip: float = option(1.0, "clip the LoRA gradient's global norm to this; 0 = no clipping")
    seed: int = option(0, "seed of the LoRA init, the batch order and dropout")
    select: bool = option(
        True,
        "keep the best held-out snapshot (lr × evaluation point); False: keep the last iterate of "
        "the single lr (the paper's protocol; the held-out CE is still measured)",
    )

    def checks(self) -> dict[str, bool]:
        return {
            "rank": self.rank >= 1,
            "alpha": self.alpha > 0,
            "dropout": 0.0 <= self.dropout < 1.0,
            "target_modules": bool(self.target_modules)
            and all(isinstance(m, str) and m for m in self.target_modules),
            "lrs": positive_finite(self.lrs),
            "epochs": self.epochs >= 1,
            "eval_every": self.eval_every >= 0,
            "weight_decay": self.weight_decay >= 0,
            "grad_clip": self.grad_clip >= 0,
            "seed": self.seed >= 0,
        }

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.select and len(self.lrs) != 1:
            raise ValueError(
                f"LoraSettings(select=False) keeps the last iterate of one learning rate; got lrs={self.lrs}"
            )


def _linear_names(blocks: nn.Module) -> list[str]:
    """Distinct leaf names of the linear layers in the blocks (what ``target_modules`` can name)."""
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in blocks.named_modules()
        if n and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    }
    return sorted(names)


class LoraRun:
    """LoRA layers injected into a model's blocks, and the fit's :class:`MethodResult`.

    After :func:`fit_lora` the model carries LoRA at the selected state, so any evaluation of
    ``parts`` evaluates LoRA. :meth:`unload` (or leaving a ``with`` block) removes the LoRA layers:
    the original modules go back in place, with their weights, ``requires_grad`` flags and
    train/eval mode as before the injection.
    """

    def __init__(self, parts: ModelParts, settings: LoraSettings):
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer

        blocks = parts.blocks
        if any(isinstance(m, BaseTunerLayer) for m in blocks.modules()) or hasattr(blocks, "peft_config"):
            raise ValueError("the model's blocks already carry PEFT layers; unload() the other run first")
        missing = [t for t in settings.target_modules if t not in _linear_names(blocks)]
        if missing:
            raise ValueError(
                f"target modules {missing} not found in the blocks of {type(parts.model).__name__}; "
                f"their linear layers are {_linear_names(blocks)}"
            )
        self.parts, self.settings = parts, settings
        self.result: MethodResult | None = None
        self._requires_grad = {n: p.requires_grad for n, p in parts.model.named_parameters()}
        self._was_training = parts.model.training
        config = LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            target_modules=list(settings.target_modules),
            bias="none",
        )
        parts.model.requires_grad_(False)
        # Into the block list only: the modules that ModelParts refers to stay the same objects.
        inject_adapter_in_model(config, blocks, adapter_name=ADAPTER_NAME)
        self._wrappers: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, attribute, LoRA layer)
        for name, module in blocks.named_modules():
            if isinstance(module, LoraLayer):
                parent_name, _, attr = name.rpartition(".")
                self._wrappers.append((blocks.get_submodule(parent_name), attr, module))
                for d in (module.lora_A, module.lora_B):  # train in float32 on a bf16/fp16 model
                    d.float()
        self.params: dict[str, nn.Parameter] = {
            n: p for n, p in blocks.named_parameters() if ".lora_A." in n or ".lora_B." in n
        }
        for p in self.params.values():
            p.requires_grad_(True)

    @property
    def attached(self) -> bool:
        return bool(self._wrappers)

    @property
    def n_trainable_params(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def state_dict(self) -> dict[str, Tensor]:
        """A CPU copy of the LoRA parameters (names relative to ``parts.blocks``)."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state[n])

    def unload(self) -> None:
        """Remove the LoRA layers and leave the model as it was before (idempotent)."""
        for parent, attr, wrapper in reversed(self._wrappers):
            setattr(parent, attr, wrapper.get_base_layer())
        self._wrappers.clear()
        self.params = {}
        if "peft_config" in self.parts.blocks.__dict__:
            del self.parts.blocks.peft_config  # set by peft on the module it injected into
        for n, p in self.parts.model.named_parameters():
            p.requires_grad_(self._requires_grad.get(n, False))
        self.parts.model.train(self._was_training)

    def __enter__(self) -> LoraRun:
        return self

    def __exit__(self, *exc) -> None:
        self.unload()


def fit_lora(
    parts: ModelParts,
    train: Sequence[Batch],
    heldout: Sequence[Batch],
    settings: LoraSettings | None = None,
    *,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> LoraRun:
    """Train LoRA with AdamW for every learning rate and keep the best held-out state.

    Every candidate starts from the same LoRA init (``lora_B = 0``: the frozen model) and runs
    ``epochs`` passes over ``train`` in a seeded order per epoch (the same for every candidate).
    The held-out CE is measured on the frozen model first (candidate None, step 0), then after
    every epoch (``step_unit`` "epoch") or every ``eval_every`` optimizer steps and at the end
    (``step_unit`` "step"). A non-finite training loss or held-out CE stops a candidate. The best
    state over all candidates and evaluations, the frozen model included, is restored in a
    ``finally``; with ``select=False`` the model keeps its last iterate instead, and ``result``
    records the last evaluation (its step as ``best_step``). On an exception the LoRA layers are
    removed before it propagates. Returns the :class:`LoraRun` that carries the model's LoRA
    layers and ``result``.
    """
    settings = settings or LoraSettings()
    if not train:
        raise ValueError("the training set is empty")
    run: LoraRun | None = None
    select = settings.select
    selector = HeldoutSelector(
        parts,
        heldout,
        snapshot=lambda: run.state_dict() if select else None,
        restore=lambda s: run.load_state_dict(s),
        on_row=on_row,
    )
    cuda = sorted({d.index or 0 for d in parts.block_devices() if d.type == "cuda"})
    step_unit = "step" if settings.eval_every > 0 else "epoch"
    stop_reasons: dict[str, str] = {}
    bar = tqdm(
        total=len(settings.lrs) * settings.epochs * len(train),
        desc="LoRA",
        unit="step",
        disable=not progress,
    )
    try:
        with torch.random.fork_rng(devices=cuda):  # seeded init and dropout; the caller's RNG is kept
            torch.manual_seed(settings.seed)
            run = LoraRun(parts, settings)
            parts.model.eval()
            init = run.state_dict()
            try:
                selector.evaluate(None, 0, epoch=0, train_loss=None)
                for lr in settings.lrs:
                    stop_reasons[f"lr={lr:g}"] = _train_candidate(
                        run, lr, train, selector, step_unit, init, bar
                    )
            finally:
                parts.model.eval()
                if select:
                    run.load_state_dict(init)
                    selector.restore_best()
    except BaseException:
        if run is not None:
            run.unload()
        raise
    finally:
        bar.close()
    run.result = selector.result(
        "lora",
        step_unit,
        last_iterate=not select,
        n_trainable_params=run.n_trainable_params,
        stop_reasons=stop_reasons,
        rank=settings.rank,
        alpha=settings.alpha,
        target_modules=list(settings.target_modules),
    )
    return run


def _train_candidate(
    run: LoraRun,
    lr: float,
    train: Sequence[Batch],
    selector: HeldoutSelector,
    step_unit: str,
    init: dict[str, Tensor],
    bar,
) -> str:
    """One learning rate from the initial LoRA state; returns why it stopped."""
    parts, s = run.parts, run.settings
    run.load_state_dict(init)
    torch.manual_seed(s.seed)  # the same dropout masks for every candidate
    params = list(run.params.values())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=s.weight_decay)
    candidate = {"lr": lr}
    losses: list[Tensor] = []  # since the last evaluation; checked there (no host sync per step)
    step = 0

    def evaluate(epoch: int) -> str | None:
        parts.model.eval()
        train_loss = float(torch.stack(losses).double().mean()) if losses else None
        losses.clear()
        ce = selector.evaluate(
            candidate, epoch if step_unit == "epoch" else step, epoch=epoch, train_loss=train_loss
        )
        bar.set_postfix(lr=f"{lr:g}", heldout_ce=f"{ce:.4f}", best=f"{selector.best_ce:.4f}")
        at = f"epoch {epoch}" if step_unit == "epoch" else f"step {step}"
        if train_loss is not None and not math.isfinite(train_loss):
            return f"non-finite training loss before {at}"
        if not math.isfinite(ce):
            return f"non-finite held-out CE at {at}"
        return None

    for epoch in range(1, s.epochs + 1):
        order = epoch_order(s.seed, epoch, len(train))
        parts.model.train(s.dropout > 0)
        for i in order:
            with torch.enable_grad():
                loss = completion_loss(parts, train[i])
                loss.backward()
            if s.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            step += 1
            bar.update()
            if s.eval_every and step % s.eval_every == 0:
                if reason := evaluate(epoch):
                    return reason
                parts.model.train(s.dropout > 0)
        if not s.eval_every and (reason := evaluate(epoch)):
            return reason
    if losses and (reason := evaluate(s.epochs)):  # eval_every > 0: the last steps
        return reason
    return f"completed {s.epochs} epochs ({step} steps)"
