"""Residual low-rank adapters ``h_l = hbar_l + B_l A_l h_{l-1}`` attached by forward hooks.

The hooks never edit the model: :meth:`ResidualAdapters.detach` leaves it bit-identical. The
correction depends on the block's *input* and is added to its *output*, so it is not a function of
any single linear layer's input and cannot be merged into the base weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from ..core import stacked
from ..models.parts import ModelParts, find_parts, fingerprint, load_model
from ..models.zoo import ALIASES, alias_dir
from .artefacts import (
    BASE_KEYS,
    read_adapter,
    read_adapter_config,
    recorded_base,
    source_record,
    write_adapter,
)


class Recording(Protocol):
    """What the hooks hand each block's input to during a recorded pass (the Stage II
    :class:`loca.method.stage2.Recorder`)."""

    def wants(self, layer: int) -> bool: ...

    def record(self, layer: int, h_in: Tensor) -> None: ...


def adapter_a(seed: int, layer: int, rank: int, d: int) -> Tensor:
    """The fixed down-projection A_l (r×d), N(0, 1/d), rebuilt from ``(seed, layer)`` alone."""
    key = hashlib.sha256(f"loca-A:{seed}:{layer}".encode()).digest()[:8]
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") & (2**63 - 1))
    return torch.randn(rank, d, generator=gen, dtype=torch.float32) / d**0.5


class ResidualAdapters:
    """One rank-r residual adapter per block, kept in float32 on the block's device."""

    def __init__(self, parts: ModelParts, rank: int = 32, seed: int = 0, a: list[Tensor] | None = None):
        """``a``: the A matrices (r×d each, e.g. from :func:`principal_a`); default: random from
        ``seed``."""
        self.parts, self.rank, self.seed = parts, rank, seed
        d = parts.hidden_size
        self.devices = parts.block_devices()
        if a is None:
            a = [adapter_a(seed, i, rank, d) for i in range(parts.num_blocks)]
        if len(a) != parts.num_blocks or any(x.shape != (rank, d) for x in a):
            raise ValueError(f"expected {parts.num_blocks} A matrices of shape ({rank}, {d})")
        # one buffer per device for A and one for B: a pass stacks them without copies
        self.A = stacked.pack(a, self.devices, torch.float32)
        self.B = stacked.pack([torch.zeros(d, rank)] * len(a), self.devices, torch.float32)
        self._handles: list = []
        self._recorder: Recording | None = None
        self._derived: dict[tuple, tuple] = {}  # per (A or B, block): its cast (see _b_state)
        self._source: Callable[[int], tuple[Tensor, Tensor]] | None = None  # see weights_from
        self._zero: dict[int, tuple] = {}  # per block: (B, version) while B is known to be zero
        self._mark_zero()

    # -- attach / detach -------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> ResidualAdapters:
        """Hook the adapters into the model. Only one set may be attached to a model at a time."""
        owner = getattr(self.parts.model, "_loca_adapters", None)
        if owner is not None and owner is not self:
            raise RuntimeError("another set of LoCA adapters is attached to this model; detach it first")
        if not self.attached:
            self.parts.model._loca_adapters = self
            self._handles = [
                block.register_forward_hook(self._hook(i), with_kwargs=True)
                for i, block in enumerate(self.parts.blocks)
            ]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if getattr(self.parts.model, "_loca_adapters", None) is self:
            del self.parts.model._loca_adapters

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Run the frozen model inside the ``with`` body; the adapters come back after it."""
        was = self.attached
        self.detach()
        try:
            yield
        finally:
            if was:
                self.attach()

    def unload(self):
        """Detach the adapters and return the base model, unchanged (as PEFT's ``unload``)."""
        self.detach()
        return self.parts.model

    def __enter__(self) -> ResidualAdapters:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @contextmanager
    def recording(self, recorder: Recording) -> Iterator[Recording]:
        """Record adapter codes at the recorder's positions during the forward passes inside."""
        self._recorder = recorder
        try:
            yield recorder
        finally:
            self._recorder = None

    @contextmanager
    def weights_from(self, source: Callable[[int], tuple[Tensor, Tensor]]) -> Iterator[None]:
        """Inside, the hooks apply every adapter with ``source(layer)`` = (Aᵀ, Bᵀ) in the hidden
        dtype, a zero B included (the correction then adds exactly zero): the fixed buffers a
        captured CUDA graph reads (:class:`loca.method.graphs.StaticWeights`)."""
        self._source = source
        try:
            yield
        finally:
            self._source = None

    def _b_state(self, layer: int, dtype: torch.dtype) -> tuple[bool, Tensor, Tensor]:
        """``(B_l may be non-zero, Aᵀ, Bᵀ)`` with A and B cast to ``dtype``, each cast recomputed
        only when its source is replaced or edited in place (its version changes): casting on
        every forward would cost a kernel launch per block. B_l counts as zero only while it is the
        tensor that :meth:`reset` or :meth:`set_b` found zero, unedited since; testing its values
        here would cost a device sync per block after every in-place edit (three per MeZO step).
        The cache holds the source tensor itself, so its identity cannot be reused by another."""
        if self._source is not None:
            return True, *self._source(layer)
        mode = (dtype, torch.is_inference_mode_enabled())  # an inference-mode cast cannot enter autograd
        b = self.B[layer]
        zero = self._zero.get(layer)
        active = zero is None or zero[0] is not b or zero[1] != b._version
        return active, self._cast(("A", layer), self.A[layer], mode), self._cast(("B", layer), b, mode)

    def _cast(self, key: tuple, source: Tensor, mode: tuple) -> Tensor:
        """``sourceᵀ`` in ``mode``'s dtype, cached while ``source`` is unchanged."""
        cached = self._derived.get(key)
        if cached is None or cached[0] is not source or cached[1] != (source._version, *mode):
            cached = (source, (source._version, *mode), source.T.to(mode[0]))
            self._derived[key] = cached
        return cached[2]

    def _mark_zero(self, zero: list[bool] | None = None) -> None:
        """Record which B are zero now: ``zero`` per block if known, else one check per block
        (outside any forward)."""
        zero = zero if zero is not None else [not b.any() for b in self.B]
        self._zero = {i: (b, b._version) for i, b in enumerate(self.B) if zero[i]}

    def _hook(self, layer: int):
        def hook(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = output[0] if isinstance(output, tuple) else output
            if h_in.device != h_out.device:  # spread over GPUs, a hook may see the previous block's
                h_in = h_in.to(h_out.device)
            rec = self._recorder
            if rec is not None and rec.wants(layer):
                rec.record(layer, h_in)
            active, a, b = self._b_state(layer, h_in.dtype)
            if not active:
                return None
            # A and B are stored in float32; the full-sequence correction runs in the hidden
            # dtype, so a bf16 backbone's activations are not doubled by float32 copies (the
            # correction is rounded to that dtype when added anyway). Statistics stay float32.
            d = h_out.shape[-1]
            h_new = torch.addmm(h_out.reshape(-1, d), (h_in @ a).reshape(-1, a.shape[1]), b)
            h_new = h_new.view(h_out.shape)
            return (h_new, *output[1:]) if isinstance(output, tuple) else h_new

        return hook

    # -- state ------------------------------------------------------------------------------
    def get_b(self) -> list[Tensor]:
        return [b.detach().cpu().clone() for b in self.B]

    def set_b(self, bs: list[Tensor]) -> None:
        if len(bs) != len(self.B):
            raise ValueError(f"expected {len(self.B)} B matrices, got {len(bs)}")
        for i, b in enumerate(bs):
            if b.shape != self.B[i].shape:
                raise ValueError(f"B[{i}] has shape {tuple(b.shape)}, expected {tuple(self.B[i].shape)}")
        zero = [not b.any() for b in bs]  # on the given tensors (usually on the CPU): no GPU sync
        for dst, b in zip(self.B, bs, strict=True):  # in place: B keeps its buffer (no second copy)
            dst.copy_(b)
        self._mark_zero(zero)

    def reset(self) -> None:
        for b in self.B:
            b.zero_()
        self._mark_zero()

    def norm(self) -> float:
        return float(sum(float(b.double().pow(2).sum()) for b in self.B) ** 0.5)

    # -- save / load ------------------------------------------------------------------------
    def config(self) -> dict:
        return {
            "format": "loca-adapter",
            "version": 1,
            "rank": self.rank,
            "seed": self.seed,
            "hidden_size": self.parts.hidden_size,
            "num_blocks": self.parts.num_blocks,
            "fingerprint": fingerprint(self.parts),
            **base_model_record(self.parts.model),
            "base_model_revision": getattr(self.parts.model.config, "_commit_hash", None),
        }

    def save_pretrained(self, directory: str | Path, extra: dict | None = None) -> Path:
        """Write the adapter folder (:func:`loca.method.artefacts.write_adapter`): A and B of every
        block, the config and a model card. ``extra`` adds to the config: what it was fitted on
        (``loca fit`` records the base model as named, the task, template and ``add_eos``). A is
        stored (r×d per block, small), so a loaded adapter never depends on a random generator's
        stream. The write is atomic."""
        tensors = {f"B.{i}": b.contiguous() for i, b in enumerate(self.get_b())}
        tensors.update({f"A.{i}": a.detach().cpu().contiguous() for i, a in enumerate(self.A)})
        return write_adapter(directory, tensors, {**self.config(), **(extra or {})})

    @classmethod
    def from_pretrained(cls, model, directory: str | Path) -> ResidualAdapters:
        """Load adapters saved by :meth:`save_pretrained` for ``model`` (a plain Hugging Face causal
        LM or its :class:`ModelParts`), detached; the checkpoint must match. See also
        :func:`from_pretrained`, which attaches them."""
        parts = model if isinstance(model, ModelParts) else find_parts(model)
        tensors, cfg, weights = read_adapter(directory, fingerprint(parts), parts.hidden_size)
        rank, seed, n = cfg["rank"], cfg["seed"], parts.num_blocks
        try:
            stored_a = [tensors[f"A.{i}"] for i in range(n)] if "A.0" in tensors else None
            adapters = cls(parts, rank=rank, seed=seed, a=stored_a)
            adapters.set_b([tensors[f"B.{i}"] for i in range(n)])
        except (KeyError, ValueError) as exc:
            raise ValueError(
                f"{weights}: does not hold {n} blocks' adapters of rank {rank} ({exc})"
            ) from None
        if not all(torch.isfinite(t).all() for t in (*adapters.A, *adapters.B)):
            raise ValueError(f"{weights}: holds NaN or Inf values")
        return adapters


def from_pretrained(model, directory: str | Path) -> ResidualAdapters:
    """The LoCA adapters saved in ``directory``, attached to ``model`` (a plain Hugging Face causal
    LM): ``model(...)`` and ``model.generate(...)`` then run with them; ``.unload()`` (or
    ``.detach()``) returns the frozen model, ``with adapters.disable_adapter():`` runs it for a
    while. Refused for another checkpoint than the one they were fitted on."""
    return ResidualAdapters.from_pretrained(model, directory).attach()


def load_adapted(directory: str | Path, model: str | None = None, **kwargs):
    """``(model, tokenizer, adapters)``: the base model an adapter folder records (as it was named:
    alias, hub id at its recorded revision, or path), loaded by :func:`loca.models.parts.load_model`
    (``kwargs``: ``device``, ``dtype``, ``trust_remote_code``, ``device_map``), with the adapters
    attached (PEFT's ``AutoPeftModelForCausalLM.from_pretrained``). ``model`` loads another
    checkpoint instead (refused unless it is the one the adapters were fitted on)::

        model, tokenizer, adapters = loca.load_adapted("runs/sst2/adapter")
    """
    config = read_adapter_config(directory)
    revision = kwargs.pop("revision", None)
    if model is None:
        model, recorded = recorded_base(config)
        if model is None:
            raise ValueError(
                f"adapter {directory} does not record its base model; name it (model=..., or --model)"
            )
        revision = revision or recorded
    base, tokenizer = load_model(model, revision=revision, **kwargs)
    return base, tokenizer, from_pretrained(base, directory)


def base_model_record(model) -> dict:
    """``base_model`` and ``base_model_path`` (:func:`loca.method.artefacts.source_record`) of a
    model loaded from ``model.config._name_or_path``: a built-in alias's folder is recorded as the
    alias."""
    name = getattr(model.config, "_name_or_path", None) or None
    if name is None:
        return dict.fromkeys(BASE_KEYS)
    resolved = Path(name).expanduser().resolve()
    alias = next((a for a in ALIASES if alias_dir(a).resolve() == resolved), None)
    return source_record(alias, BASE_KEYS, local=False) if alias else source_record(name, BASE_KEYS)
