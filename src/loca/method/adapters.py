"""Residual low-rank adapters ``h_l = hbar_l + B_l A_l h_{l-1}`` attached by forward hooks.

The hooks never edit the model: :meth:`ResidualAdapters.detach` leaves it bit-identical. The
correction depends on the block's *input* and is added to its *output*, so it is not a function of
any single linear layer's input and cannot be merged into the base weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..core import stacked
from ..core.ridge import nystrom_top_eigenvectors
from ..infra import distributed
from ..infra.io import atomic_dir, atomic_write_json
from ..models.parts import ModelParts, at_positions, find_parts, fingerprint

# loca's own file names: PEFT's (adapter_model.safetensors, adapter_config.json) would make PEFT
# and transformers mistake the folder for a PEFT adapter they cannot read. Folders written with
# those names by earlier versions still load.
ADAPTER_WEIGHTS = "loca_adapter.safetensors"
ADAPTER_CONFIG = "loca_adapter.json"
LEGACY_NAMES = ("adapter_model.safetensors", "adapter_config.json")
CONFIG_NAMES = (ADAPTER_CONFIG, LEGACY_NAMES[1])


def adapter_a(seed: int, layer: int, rank: int, d: int) -> Tensor:
    """The fixed down-projection A_l (r×d), N(0, 1/d), rebuilt from ``(seed, layer)`` alone."""
    key = hashlib.sha256(f"loca-A:{seed}:{layer}".encode()).digest()[:8]
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") & (2**63 - 1))
    return torch.randn(rank, d, generator=gen, dtype=torch.float32) / d**0.5


@torch.inference_mode()
def principal_a(parts: ModelParts, batches, rank: int, seed: int = 0, oversample: int = 10) -> list[Tensor]:
    """A data-dependent A_l (r×d, orthonormal rows): the top-r principal directions (uncentred) of
    block l's input at the predict positions, from one forward pass over ``batches``.

    Each block streams only the sketch ``Σ Hᵀ(HΩ)`` (d×m, m = r + ``oversample``) with a seeded
    Gaussian Ω; :func:`loca.core.ridge.nystrom_top_eigenvectors` turns it into the eigenvectors, so no
    d×d matrix and no hidden state outlives its batch. Deterministic for a fixed seed on CPU."""
    d = parts.hidden_size
    m = min(d, rank + oversample)
    devices = parts.block_devices()
    omegas = [adapter_a(seed + 7919, l, m, d).T.double().to(dev) for l, dev in enumerate(devices)]
    sketches = [torch.zeros(d, m, dtype=torch.float64, device=dev) for dev in devices]
    where: dict[str, Tensor] = {}

    def hook(layer: int):
        def accumulate(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            rows = at_positions(h_in.to(sketches[layer].device), where["b"], where["t"]).double()
            sketches[layer].add_(rows.T @ (rows @ omegas[layer]))

        return accumulate

    handles = [blk.register_forward_hook(hook(l), with_kwargs=True) for l, blk in enumerate(parts.blocks)]
    try:
        for batch in distributed.shard(batches):
            b = batch.to(parts.device)
            where["b"], where["t"] = b.pos_b, b.pos_t
            parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t)
    finally:
        for h in handles:
            h.remove()
    distributed.all_reduce_sum(*sketches)  # data-parallel: the sketches are sums
    pairs = zip(sketches, omegas, strict=True)
    return [nystrom_top_eigenvectors(s, o, rank).T.float().cpu() for s, o in pairs]


class Recorder:
    """Collects, during one forward pass, each recorded block's adapter codes ``p = A h_{l-1}``
    (float32) and input norm ``||h_{l-1}||²`` at the predict positions.

    A hook only gathers the block's input rows (N×d, the hidden dtype: one kernel); whenever the
    rows waiting on a device reach ``budget_mb`` they are turned into codes and norms for all of
    those blocks at once (a few batched kernels), so a pass holds at most that much of them and a
    GPU pays few launches for recording."""

    def __init__(
        self, pos_b: Tensor, pos_t: Tensor, width: int, stacks: dict[torch.device, tuple[list[int], Tensor]],
        budget_mb: float = 1.0,
    ):  # fmt: skip
        """``width``: the batch's padded length T (flat index ``b·T + t`` of a position);
        ``stacks``: per device, the blocks recorded there in forward order and their A stacked
        (L×r×d, float32)."""
        flat = pos_b * width + pos_t
        self.flat = {flat.device: flat}  # per device: moved once, not once per block
        self.budget = budget_mb * 2**20
        self.where = {l: (dev, i) for dev, (ls, _) in stacks.items() for i, l in enumerate(ls)}
        self.a = {dev: a for dev, (_, a) in stacks.items()}
        self.waiting: dict[torch.device, list[tuple[int, Tensor]]] = {dev: [] for dev in stacks}
        self.done: dict[torch.device, list[tuple[Tensor, Tensor]]] = {dev: [] for dev in stacks}

    def wants(self, layer: int) -> bool:
        return layer in self.where

    def record(self, layer: int, h_in: Tensor) -> None:
        dev, i = self.where[layer]
        flat = self.flat.get(h_in.device)
        if flat is None:
            flat = self.flat[h_in.device] = next(iter(self.flat.values())).to(h_in.device)
        waiting = self.waiting[dev]
        waiting.append((i, h_in.reshape(-1, h_in.shape[-1]).index_select(0, flat)))
        if sum(r.numel() * r.element_size() for _, r in waiting) >= self.budget:
            self._encode(dev)

    def _encode(self, dev: torch.device) -> None:
        waiting = self.waiting[dev]
        if not waiting:
            return
        first = waiting[0][0]
        if [i for i, _ in waiting] != list(range(first, first + len(waiting))):
            raise RuntimeError("blocks were recorded out of their forward order")
        h = torch.stack([r for _, r in waiting]).float()  # G × N × d
        codes = h @ self.a[dev][first : first + len(waiting)].mT
        self.done[dev].append((codes, torch.linalg.vector_norm(h, dim=(-2, -1)).square()))
        waiting.clear()

    def codes_and_norms(self, dev: torch.device) -> tuple[Tensor, Tensor]:
        """``(p, ||h||²)`` of the blocks recorded on ``dev``: codes L×N×r and norms (L)."""
        self._encode(dev)
        done = self.done[dev]
        return torch.cat([c for c, _ in done]), torch.cat([n for _, n in done])


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
        self._recorder: Recorder | None = None
        self._derived: dict[tuple, tuple] = {}  # per (A or B, block): its cast (see _b_state)
        self._static: list[tuple[Tensor, Tensor]] = []  # per block: fixed Aᵀ, Bᵀ (CUDA graphs)
        self._static_seen: list[tuple[Tensor, int]] = []  # the B (and version) copied in last
        self._use_static = False
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
    def recording(self, recorder: Recorder) -> Iterator[Recorder]:
        """Record adapter codes at the recorder's positions during the forward passes inside."""
        self._recorder = recorder
        try:
            yield recorder
        finally:
            self._recorder = None

    def refresh_static(self, dtype: torch.dtype) -> None:
        """Copy the current B into fixed buffers (Aᵀ, Bᵀ in ``dtype``, made on the first call),
        which the hooks read inside :meth:`static_weights`: a captured CUDA graph replays the
        addresses it saw, so B must change in place there. Blocks whose B is unchanged since the
        last call (same tensor, same version) are not copied."""
        if not self._static or self._static[0][0].dtype != dtype:
            self._static = [(a.T.to(dtype).contiguous(), b.T.to(dtype).contiguous())
                            for a, b in zip(self.A, self.B, strict=True)]  # fmt: skip
        else:
            for (_, bt), b, seen in zip(self._static, self.B, self._static_seen, strict=True):
                if seen[0] is not b or seen[1] != b._version:  # B replaced or edited since
                    bt.copy_(b.T)
        self._static_seen = [(b, b._version) for b in self.B]

    @contextmanager
    def static_weights(self) -> Iterator[None]:
        """Inside, the hooks apply every adapter from the buffers of :meth:`refresh_static` (a
        zero B included: the correction then adds exactly zero), as CUDA graph capture needs."""
        if not self._static:
            raise RuntimeError("refresh_static() must fill the fixed buffers first")
        self._use_static = True
        try:
            yield
        finally:
            self._use_static = False

    def _b_state(self, layer: int, dtype: torch.dtype) -> tuple[bool, Tensor, Tensor]:
        """``(B_l may be non-zero, Aᵀ, Bᵀ)`` with A and B cast to ``dtype``, each cast recomputed
        only when its source is replaced or edited in place (its version changes): casting on
        every forward would cost a kernel launch per block. B_l counts as zero only while it is the
        tensor that :meth:`reset` or :meth:`set_b` found zero, unedited since; testing its values
        here would cost a device sync per block after every in-place edit (three per MeZO step).
        The cache holds the source tensor itself, so its identity cannot be reused by another."""
        if self._use_static:
            return True, *self._static[layer]
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
            "base_model": getattr(self.parts.model.config, "_name_or_path", None) or None,
            "base_model_revision": getattr(self.parts.model.config, "_commit_hash", None),
        }

    def save_pretrained(self, directory: str | Path, extra: dict | None = None) -> Path:
        """Write ``loca_adapter.safetensors`` (A and B of every block), ``loca_adapter.json`` and
        a model-card ``README.md``.

        A is stored (r×d per block, small), so a loaded adapter never depends on a random
        generator's stream. The write is atomic.
        """
        tensors = {f"B.{i}": b.contiguous() for i, b in enumerate(self.get_b())}
        tensors.update({f"A.{i}": a.detach().cpu().contiguous() for i, a in enumerate(self.A)})
        config = {**self.config(), **(extra or {})}
        with atomic_dir(directory, CONFIG_NAMES, "loca-adapter") as tmp:
            save_file(tensors, tmp / ADAPTER_WEIGHTS)
            atomic_write_json(tmp / ADAPTER_CONFIG, config)
            (tmp / "README.md").write_text(_model_card(config))
        return Path(directory)

    @classmethod
    def from_pretrained(cls, model, directory: str | Path) -> ResidualAdapters:
        """Load adapters saved by :meth:`save_pretrained` for ``model`` (a plain Hugging Face causal
        LM or its :class:`ModelParts`), detached; the checkpoint must match. See also
        :func:`from_pretrained`, which attaches them."""
        parts = model if isinstance(model, ModelParts) else find_parts(model)
        directory = Path(directory)
        weights_name, cfg_name = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)
        if not (directory / cfg_name).is_file() and (directory / LEGACY_NAMES[1]).is_file():
            weights_name, cfg_name = LEGACY_NAMES
        cfg_path = directory / cfg_name
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{directory / ADAPTER_CONFIG} not found: not a LoCA adapter folder")
        cfg = read_json_object(cfg_path)
        if cfg.get("format") != "loca-adapter":
            raise ValueError(f"{cfg_path}: not a LoCA adapter config (format {cfg.get('format')!r})")
        check_fingerprint(cfg.get("fingerprint"), fingerprint(parts), str(directory))
        rank, seed = cfg.get("rank"), cfg.get("seed")
        if not isinstance(rank, int) or not 1 <= rank <= parts.hidden_size or not isinstance(seed, int):
            raise ValueError(
                f"{cfg_path}: 'rank' must be an integer in 1..{parts.hidden_size} and 'seed' an "
                f"integer (got rank={rank!r}, seed={seed!r})"
            )
        tensors = read_safetensors(directory / weights_name)
        n = parts.num_blocks
        try:
            stored_a = [tensors[f"A.{i}"] for i in range(n)] if "A.0" in tensors else None
            adapters = cls(parts, rank=rank, seed=seed, a=stored_a)
            adapters.set_b([tensors[f"B.{i}"] for i in range(n)])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{directory / weights_name}: does not hold {n} blocks' adapters "
                             f"of rank {rank} ({exc})") from None  # fmt: skip
        if not all(torch.isfinite(t).all() for t in (*adapters.A, *adapters.B)):
            raise ValueError(f"{directory / weights_name}: holds NaN or Inf values")
        return adapters


def from_pretrained(model, directory: str | Path) -> ResidualAdapters:
    """The LoCA adapters saved in ``directory``, attached to ``model`` (a plain Hugging Face causal
    LM): ``model(...)`` and ``model.generate(...)`` then run with them; ``.unload()`` (or
    ``.detach()``) returns the frozen model, ``with adapters.disable_adapter():`` runs it for a
    while. Refused for another checkpoint than the one they were fitted on."""
    return ResidualAdapters.from_pretrained(model, directory).attach()


def _model_card(config: dict) -> str:
    """A short README for an adapter folder: what it is and how to load it."""
    sel = config.get("selection") or {}
    lines = [
        "# LoCA adapter",
        "",
        "Residual low-rank adapters `h_l = hbar_l + B_l A_l h_{l-1}` for every transformer block,",
        "fitted forward-only by [loca](https://pypi.org/project/loca/) (Local Credit Assignment).",
        "",
        f"- base model: `{config.get('base_model')}` (weights fingerprint "
        f"`{config['fingerprint']['weights_sha256'][:16]}…`, {config['num_blocks']} blocks, "
        f"d = {config['hidden_size']})",
        f"- rank r = {config['rank']}, feedback rank k = {config.get('feedback_rank', 'n/a')}, "
        f"seed {config['seed']}",
        f"- task: {config.get('task', 'n/a')}; selection: held-out CE {sel.get('heldout_ce', 'n/a')} "
        f"at iteration {sel.get('iteration', 'n/a')} (η {sel.get('eta', 'n/a')})",
        *_metrics_lines(config.get("metrics")),
        "",
        "```python",
        "import loca",
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained(\"<the base model>\")",
        "adapters = loca.from_pretrained(model, \"<this folder>\")  # attached; .unload() removes them",
        "```",
        "",
        "Not a PEFT adapter: PEFT and transformers cannot load it; loca checks the base model's",
        "fingerprint and refuses another checkpoint.",
        "",
    ]
    return "\n".join(lines)


def _metrics_lines(metrics: dict | None) -> list[str]:
    if not metrics:
        return []
    f, m = metrics["frozen"], metrics["loca"]
    return [f"- test ({m['n_test']} examples): CE {f['test_ce']:.4f} → {m['test_ce']:.4f}, "
            f"acc {f['test_acc']:.3f} → {m['test_acc']:.3f} (frozen → LoCA)"]  # fmt: skip


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path``, or a ValueError naming the file."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return obj


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file, or a ValueError naming the file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return load_file(path)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


class CheckpointMismatchError(ValueError):
    """An artefact was fitted on a different checkpoint than the model it is used with."""


def check_fingerprint(saved: dict | None, current: dict, what: str) -> None:
    if isinstance(saved, dict) and saved.get("fingerprint_version") != current.get("fingerprint_version"):
        raise CheckpointMismatchError(
            f"{what} was saved by an older loca whose checkpoint fingerprint cannot be checked "
            "against this one; calibrate/fit again"
        )
    if saved != current:
        diff = [k for k in current if (saved or {}).get(k) != current[k]]
        raise CheckpointMismatchError(
            f"{what} was made for another checkpoint (differs in: {', '.join(diff) or 'all'}); "
            "calibrate/fit again for this model"
        )
