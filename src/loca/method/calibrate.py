"""Stage I: one probe backward pass, then per-block rank-k feedback maps ``F_l: e -> g_l``."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from ..config import LocaConfig
from ..core import stacked
from ..core.head import head_loss_and_error
from ..core.ridge import (
    FeedbackFactors,
    alignment,
    feedback_factors,
    gate_mask,
    gated_feedback_factors,
    random_factors,
)
from ..data.batching import ROLES, Encoded, make_batches
from ..infra import distributed
from ..infra.io import atomic_dir, atomic_write_json
from ..infra.versions import versions
from ..models.parts import ModelParts, at_positions, fingerprint
from .adapters import check_fingerprint, read_json_object, read_safetensors

_DEFAULTS = LocaConfig()  # the keyword defaults below are LocaConfig's
MAPS_WEIGHTS = "feedback_maps.safetensors"
MAPS_CONFIG = "feedback_config.json"
GATES = {"none": 1, "role": len(ROLES)}  # feedback_gate -> number of maps per block


@dataclass
class FeedbackMaps:
    """The calibrated maps of every block, as factors, with the checkpoint they belong to."""

    factors: list[FeedbackFactors]
    fingerprint: dict
    meta: dict = field(default_factory=dict)

    @property
    def gate(self) -> str:
        """How a position picks its map: 'none' (one map) or 'role' (one per :data:`ROLES`)."""
        return self.meta.get("feedback_gate", "none")

    @property
    def gates(self) -> int:
        return GATES[self.gate]

    @property
    def width(self) -> int:
        """Columns of the side-by-side factors: gates × rank (the Stage II statistics' k)."""
        return self.factors[0].v.shape[1]

    @property
    def rank(self) -> int:
        """Rank k of each map."""
        return self.width // self.gates

    def mask(self, roles: Tensor, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """N × width: the columns of each position's map (None for one map)."""
        return gate_mask(roles, self.gates, self.rank, dtype)

    def sigma(self, layer: int) -> Tensor:
        """Singular values of block ``layer``'s map (the column norms of U_k Σ_k)."""
        return self.factors[layer].us.norm(dim=0)

    def to_blocks(self, parts: ModelParts) -> FeedbackMaps:
        """Copy each block's factors to that block's device, the blocks of a device as slices of one
        buffer per factor (so a Stage II pass takes all of them side by side without a copy)."""
        devices = parts.block_devices()
        us = stacked.pack([f.us for f in self.factors], devices, self.factors[0].us.dtype)
        v = stacked.pack([f.v for f in self.factors], devices, self.factors[0].v.dtype, dim=1)  # side by side
        factors = [FeedbackFactors(*p) for p in zip(us, v, strict=True)]
        return FeedbackMaps(factors, self.fingerprint, self.meta)

    def nbytes(self) -> int:
        return sum(
            f.us.numel() * f.us.element_size() + f.v.numel() * f.v.element_size() for f in self.factors
        )

    def save_pretrained(self, directory: str | Path) -> Path:
        with atomic_dir(directory, MAPS_CONFIG, "loca-feedback-maps") as tmp:
            tensors = {}
            for i, f in enumerate(self.factors):
                tensors[f"us.{i}"] = f.us.detach().cpu().contiguous()
                tensors[f"v.{i}"] = f.v.detach().cpu().contiguous()
            save_file(tensors, tmp / MAPS_WEIGHTS)
            atomic_write_json(
                tmp / MAPS_CONFIG,
                {"format": "loca-feedback-maps", "version": 1, "fingerprint": self.fingerprint, **self.meta},
            )
        return Path(directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, parts: ModelParts | None = None) -> FeedbackMaps:
        """Load maps; with ``parts``, refuse maps calibrated on another checkpoint."""
        directory = Path(directory)
        cfg_path = directory / MAPS_CONFIG
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path} not found: not a LoCA feedback-map folder")
        cfg = read_json_object(cfg_path)
        if cfg.get("format") != "loca-feedback-maps" or not isinstance(cfg.get("fingerprint"), dict):
            raise ValueError(f"{cfg_path}: not a LoCA feedback-map config")
        if parts is not None:
            check_fingerprint(cfg.get("fingerprint"), fingerprint(parts), f"feedback maps {directory}")
        tensors = read_safetensors(directory / MAPS_WEIGHTS)
        n = cfg["fingerprint"].get("num_blocks")
        try:
            factors = [FeedbackFactors(tensors[f"us.{i}"], tensors[f"v.{i}"]) for i in range(n)]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{directory / MAPS_WEIGHTS}: does not hold {n} blocks' maps ({exc})") from None
        shapes = {(f.us.shape, f.v.shape) for f in factors}
        if len(shapes) != 1 or factors[0].us.shape != factors[0].v.shape or factors[0].us.ndim != 2:
            raise ValueError(f"{directory / MAPS_WEIGHTS}: inconsistent map shapes")
        if not all(torch.isfinite(f.us).all() and torch.isfinite(f.v).all() for f in factors):
            raise ValueError(f"{directory / MAPS_WEIGHTS}: holds NaN or Inf values")
        meta = {k: v for k, v in cfg.items() if k not in ("format", "version", "fingerprint")}
        gate = meta.get("feedback_gate", "none")
        if gate not in GATES or factors[0].v.shape[1] % GATES[gate]:
            raise ValueError(f"{cfg_path}: feedback_gate {gate!r} does not match the maps' shape")
        maps = cls(factors, cfg["fingerprint"], meta)
        return maps.to_blocks(parts) if parts is not None else maps


@contextmanager
def checkpointed(blocks) -> Iterator[None]:
    """Run every block under ``torch.utils.checkpoint`` (non-reentrant) inside the ``with`` body:
    the backward recomputes a block's internals instead of keeping them. Hooks on the blocks run
    as before (they wrap the checkpointed call); the original ``forward`` comes back after."""
    saved = []
    for block in blocks:
        own = block.__dict__.get("forward")  # set on the instance, e.g. by accelerate's hooks
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        saved.append((block, own))
    try:
        yield
    finally:
        for block, own in saved:
            if own is None:
                del block.forward
            else:
                block.forward = own


def probe_gradients(
    parts: ModelParts, items: Sequence[Encoded], probe_micro_batch: int, pad_id: int,
    progress: bool = False, recompute: bool = False, memory_mb: float = 0.0, synthetic: int = 0,
    seed: int = 0,
) -> tuple[Tensor, list[Tensor]]:
    """Head errors E (N×d) and true block-output gradients G_l (N×d) at every predict position.

    One forward and one backward pass per micro-batch: the backward starts from ``n(h_L)`` with the
    exact head error as its incoming gradient, so no logits enter the autograd graph, and no
    parameter gradient is computed or stored (the backward runs to the input embeddings only,
    whatever the parameters' ``requires_grad``: a model loaded elsewhere keeps ``.grad`` None).
    Peak memory is that of one micro-batch's forward+backward; with ``recompute`` (see
    :func:`checkpointed`) only the block boundaries and one block's internals are kept. With
    ``memory_mb`` > 0 a micro-batch also holds at most the padded tokens that fit that budget,
    from the peak of a trial step on the longest sequence (:func:`probe_token_budget`). Rows come
    in the same order whatever the micro-batches (sequences sorted by length).

    With ``synthetic`` = K > 0, each micro-batch's forward also carries K more backward passes of
    synthetic head errors (:func:`synthetic_errors`), and their rows follow the natural ones: set
    k of K after set k − 1, each in the natural rows' order (``(K + 1)·N`` rows in all).
    """
    errors: list[Tensor] = []
    grads: list[list[Tensor]] = [[] for _ in parts.blocks]
    max_tokens = probe_token_budget(parts, items, pad_id, recompute, memory_mb) if memory_mb > 0 else None
    batches = make_batches(items, pad_id, batch_size=probe_micro_batch, max_tokens=max_tokens)
    draws = synthetic_tokens(items, [b.n_positions for b in batches], synthetic, seed)
    mine = distributed.owned(len(batches))  # data-parallel: this rank's micro-batches
    shown = tqdm(mine, desc="calibrate", unit="micro-batch", leave=False,
                 disable=not progress or not distributed.is_main())  # fmt: skip
    for index in shown:
        # each set of errors as one leading slice: natural first, then the synthetic sets
        e, captured = _probe_step(parts, batches[index], recompute, draws[index])
        errors.append(e)
        for i in range(parts.num_blocks):  # with the head error: the ridge fits pair them
            grads[i].append(captured[i].to(e.device))
    if distributed.active():  # every rank gets every row, in the one-process order
        device = parts.device
        pairs = enumerate(zip(mine, errors, strict=True))
        rows = {i: (e.cpu(), [g[k].cpu() for g in grads]) for k, (i, e) in pairs}
        for part in distributed.gather_objects(rows):
            rows.update(part)
        ordered = [rows[i] for i in range(len(batches))]
        errors = [e.to(device) for e, _ in ordered]
        grads = [[gs[l].to(device) for _, gs in ordered] for l in range(parts.num_blocks)]
    rows = lambda parts_: torch.cat(parts_, dim=1).flatten(0, 1)  # noqa: E731  (sets × N) rows, set-major
    return rows(errors), [rows(g) for g in grads]


def synthetic_tokens(items: Sequence[Encoded], rows: Sequence[int], synthetic: int, seed: int,
                     ) -> list[Tensor]:  # fmt: skip
    """For each micro-batch (``rows`` predict positions each, in order), ``synthetic`` × rows tokens j
    drawn uniformly from the probe's target tokens, seeded: the same draw for a position whatever
    the micro-batches (one draw over all rows, then split)."""
    if not synthetic:
        return [torch.empty(0, n, dtype=torch.long) for n in rows]
    vocab = torch.tensor(sorted({t for it in items for t in it.completion}))
    digest = hashlib.sha256(f"loca-synthetic:{seed}".encode()).digest()[:8]
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    j = vocab[torch.randint(len(vocab), (synthetic, sum(rows)), generator=gen)]
    return list(j.split(list(rows), dim=1))


def synthetic_errors(head_weight: Tensor, targets: Tensor, tokens: Tensor) -> Tensor:
    """Head errors ``W_u[j] − W_u[y]`` (K×N×d) of a model that put all its mass on another answer
    token j (``tokens``, K×N). They are probe directions, not errors the model makes: the block
    gradient is linear in the error at a fixed state (``g_l = J_l(h)ᵀ e``), so their exact gradients
    teach a map that relation along the directions the errors take once the answer format is learned
    (the competition between answer tokens)."""
    w = head_weight.detach()
    return w[tokens.to(w.device)].float() - w[targets].float()


def _probe_step(parts: ModelParts, batch, recompute: bool, tokens: Tensor | None = None,
                ) -> tuple[Tensor, dict[int, Tensor]]:  # fmt: skip
    """One micro-batch's head errors and block-output gradients at its predict positions, each with a
    leading dimension of 1 + K error sets: the natural one and, for ``tokens`` (K×N, see
    :func:`synthetic_tokens`), K synthetic ones (one backward pass each through one forward)."""
    b = batch.to(parts.device)
    embed = parts.model.get_input_embeddings()
    captured: dict[int, Tensor] = {}
    make_hook = partial(_grad_capture_hook, captured, b.pos_b, b.pos_t)
    handles = [blk.register_forward_hook(make_hook(i)) for i, blk in enumerate(parts.blocks)]
    sets: list[dict[int, Tensor]] = []
    try:
        with torch.enable_grad(), checkpointed(parts.blocks) if recompute else nullcontext():
            embeds = embed(b.input_ids).detach().requires_grad_(True)
            hn = parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t, inputs_embeds=embeds)
            with torch.no_grad():
                _, e = head_loss_and_error(hn.detach(), parts.head.weight, parts.head.bias, b.targets,
                                           parts.transform)  # fmt: skip
                errors = [e.float()]
                if tokens is not None and len(tokens):
                    errors += list(synthetic_errors(parts.head.weight, b.targets, tokens))
            for k, err in enumerate(errors):
                hn.backward(err.to(hn.dtype), inputs=[embeds], retain_graph=k < len(errors) - 1)
                sets.append(dict(captured))
    finally:
        for h in handles:
            h.remove()
    if any(len(c) != parts.num_blocks for c in sets):
        raise RuntimeError(f"captured gradients for {len(sets[-1])} of {parts.num_blocks} blocks")
    stacked_sets = {l: torch.stack([c[l] for c in sets]) for l in range(parts.num_blocks)}
    return torch.stack(errors), stacked_sets


def probe_token_budget(parts: ModelParts, items: Sequence[Encoded], pad_id: int, recompute: bool,
                       memory_mb: float) -> int | None:  # fmt: skip
    """The padded tokens a probe micro-batch may hold within ``memory_mb``: one trial step on the
    longest sequence measures the peak per token (GPU: allocated memory; CPU: sampled RSS), and
    the budget is scaled from it, never below that one sequence. None when the trial shows no
    measurable growth (everything fits)."""
    from ..bench.measure import PeakMemory

    longest = max(items, key=lambda it: len(it.ids))
    trial = make_batches([longest], pad_id, batch_size=1)[0]
    with PeakMemory(parts.device) as mem:
        _probe_step(parts, trial, recompute)
    tokens = len(longest.ids)
    if not mem.peak_mb > 0:
        return None
    return max(tokens, int(memory_mb / (mem.peak_mb / tokens)))


def probe_roles(items: Sequence[Encoded], pad_id: int) -> Tensor:
    """The role (:data:`loca.data.batching.ROLES`) of each row :func:`probe_gradients` returns
    for ``items`` (rows come in one order whatever the micro-batches)."""
    return make_batches(items, pad_id, batch_size=len(items))[0].roles


def _pooled(pool: list[tuple[Tensor, list[Tensor], Tensor]]) -> tuple[Tensor, list[Tensor], Tensor]:
    """Stack several probes' errors, gradients and roles, each probe's rows scaled by 1/RMS(E)."""
    scales = [1.0 / max(float(e.pow(2).mean().sqrt()), 1e-30) for e, _, _ in pool]
    errors = torch.cat([c * e for c, (e, _, _) in zip(scales, pool, strict=True)])
    blocks = len(pool[0][1])
    grads = [torch.cat([c * g[l] for c, (_, g, _) in zip(scales, pool, strict=True)]) for l in range(blocks)]
    return errors, grads, torch.cat([r for _, _, r in pool])


def fit_factors(errors: Tensor, grads: list[Tensor], roles: Tensor, gate: str, beta_rel: float,
                rank: int) -> list[FeedbackFactors]:  # fmt: skip
    """Every block's map(s) from probe rows: one map, or one per role (``gate='role'``)."""
    if gate == "none":
        return feedback_factors(errors, grads, beta_rel, rank)
    if gate not in GATES:
        raise ValueError(f"feedback_gate must be one of {sorted(GATES)}, got {gate!r}")
    return gated_feedback_factors(errors, grads, roles, GATES[gate], beta_rel, rank)


def _grad_capture_hook(captured: dict[int, Tensor], pos_b: Tensor, pos_t: Tensor, layer: int):
    """A forward hook that stores dLoss/dh_layer at the predict positions during backward."""

    def save_grad(g: Tensor) -> None:
        captured[layer] = at_positions(g, pos_b, pos_t).detach().float()

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        out.register_hook(save_grad)

    return hook


def select_probe(items: Sequence[Encoded], n_positions: int, seed: int) -> list[Encoded]:
    """A seeded subset of ``items`` with at least ``n_positions`` predict positions (or all)."""
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen, total = [], 0
    for i in order:
        if total >= n_positions:
            break
        chosen.append(items[i])
        total += len(items[i].completion)
    return chosen


def calibrate(
    parts: ModelParts,
    probe: Sequence[Encoded],
    heldout_probe: Sequence[Encoded] = (),
    *,
    feedback_rank: int = _DEFAULTS.feedback_rank,
    beta_rel: float = _DEFAULTS.beta_rel,
    feedback_gate: str = _DEFAULTS.feedback_gate,
    probe_synthetic: int = _DEFAULTS.probe_synthetic,
    probe_micro_batch: int = _DEFAULTS.probe_micro_batch,
    probe_checkpoint: bool = _DEFAULTS.probe_checkpoint,
    probe_memory_mb: float = _DEFAULTS.probe_memory_mb,
    pad_id: int = 0,
    seed: int = 0,
    pool: list[tuple[Tensor, list[Tensor], Tensor]] | None = None,
    progress: bool = False,
) -> FeedbackMaps:
    """Fit every block's feedback map from one probe pass and report alignment diagnostics.

    ``probe`` are encoded training sequences (see :func:`select_probe`); ``heldout_probe``, if
    given, only serves the held-out alignment diagnostic. With ``pool`` (a list, possibly empty)
    the maps are fitted on this probe's errors and gradients together with those already in
    ``pool`` (earlier probes, e.g. at other adapter states), each probe weighted equally (its rows
    scaled by 1/RMS of its errors, which keeps every pair's relation ``g = F e``), and this probe's
    are appended to ``pool``. With ``probe_synthetic`` = K > 0 the probe's synthetic rows
    (:func:`synthetic_errors`) join the fit as one more such set; the diagnostics use the natural
    rows only.
    """
    if not probe:
        raise ValueError("the calibration probe is empty")
    was_training = parts.model.training
    parts.model.eval()
    try:
        errors, grads = probe_gradients(parts, probe, probe_micro_batch, pad_id, progress, probe_checkpoint,
                                        probe_memory_mb, probe_synthetic, seed)  # fmt: skip
        roles = probe_roles(probe, pad_id).to(errors.device)
        n = roles.shape[0]  # natural rows first, then the synthetic sets (one pooled set, equal weight)
        sets = [(errors[:n], [g[:n] for g in grads], roles)]
        if probe_synthetic:
            sets.append((errors[n:], [g[n:] for g in grads], roles.repeat(probe_synthetic)))
        errors, grads = sets[0][:2]
        if pool is not None:  # a pool is always scaled (_pooled); a lone natural probe is fitted as it is
            pool.extend(sets)
            sets = pool
        fitted = sets[0] if pool is None and len(sets) == 1 else _pooled(sets)
        factors = fit_factors(*fitted, feedback_gate, beta_rel, feedback_rank)
        gates = GATES[feedback_gate]
        rank = factors[0].v.shape[1] // gates
        mask = gate_mask(roles, gates, rank)
        gen = torch.Generator().manual_seed(seed)
        d = parts.hidden_size
        random_maps = [random_factors(d, rank, gen) for _ in factors]
        diag = {
            "probe": [alignment(f, errors, g, mask) for f, g in zip(factors, grads, strict=True)],
            "random": [
                alignment(r.to_device(errors.device), errors, g)
                for r, g in zip(random_maps, grads, strict=True)
            ],
        }
        if heldout_probe:
            h_err, h_grads = probe_gradients(
                parts, heldout_probe, probe_micro_batch, pad_id, recompute=probe_checkpoint,
                memory_mb=probe_memory_mb,
            )  # fmt: skip
            h_roles = probe_roles(heldout_probe, pad_id)
            h_mask = gate_mask(h_roles, gates, rank)
            diag["heldout"] = [alignment(f, h_err, g, h_mask) for f, g in zip(factors, h_grads, strict=True)]
    finally:
        parts.model.train(was_training)
    if max(diag["probe"]) <= 0:
        warnings.warn(
            "LoCA calibration: feedback alignment is non-positive in every block; the maps carry no "
            "gradient information and Stage II will not improve the model",
            RuntimeWarning,
            stacklevel=2,
        )
    meta = {
        "probes_pooled": len(pool) if pool is not None else 1,
        "feedback_rank": rank,
        "feedback_gate": feedback_gate,
        "beta_rel": beta_rel,
        "probe_sequences": len(probe),
        "probe_positions": int(errors.shape[0]),
        "probe_synthetic": probe_synthetic,
        "heldout_probe_positions": int(h_err.shape[0]) if heldout_probe else 0,
        "alignment": diag,
        "versions": versions(),
    }
    # contiguous, as saved: the maps in memory and reloaded ones give bit-identical fits
    factors = [FeedbackFactors(f.us.cpu().contiguous(), f.v.cpu().contiguous()) for f in factors]
    maps = FeedbackMaps(factors, fingerprint(parts), meta)
    return maps.to_blocks(parts)


class Calibrator:
    """Stage I bound to one run's data and :class:`loca.config.LocaConfig`: a seeded probe of
    ``probe_positions`` predict positions from the training items, and a held-out probe a quarter
    that size (seed + 1) for the alignment diagnostic.

    :meth:`calibrate` fits the maps at the model's current state, adapters included, so the
    same object serves the first calibration and any re-calibration during a fit."""

    def __init__(self, parts: ModelParts, train: Sequence[Encoded], heldout: Sequence[Encoded], cfg,
                 pad_id: int, progress: bool = False):  # fmt: skip
        self.parts, self.cfg, self.pad_id, self.progress = parts, cfg, pad_id, progress
        self.train, self.heldout = list(train), list(heldout)
        self.probe = select_probe(train, cfg.probe_positions, cfg.seed)
        self.heldout_probe = (
            select_probe(heldout, max(1, cfg.probe_positions // 4), cfg.seed + 1) if heldout else []
        )

    def calibrate(self) -> FeedbackMaps:
        """Stage I as configured: one probe at the model's current state, or with
        ``calibration_rounds`` R > 1, R probes pooled: after each, a short forward-only fit
        (``calibration_round_iters`` steps from B = 0 with the maps so far) moves the adapters to
        where the next probe is taken, so the maps also fit the errors that remain once the first
        steps have been taken. The adapters are removed again: Stage II starts from B = 0."""
        rounds = self.cfg.calibration_rounds
        if rounds == 1:
            return self.refit()
        from dataclasses import replace

        from ..data.batching import make_batches
        from .fit import fit

        cfg = replace(self.cfg, max_iters=self.cfg.calibration_round_iters, recalibrate_every=0,
                      alignment_every=0, calibration_rounds=1)  # fmt: skip
        train = make_batches(self.train, self.pad_id, cfg.batch_size)
        heldout = make_batches(self.heldout, self.pad_id, cfg.batch_size)
        pool: list = []
        maps = self.refit(pool)
        for _ in range(rounds - 1):
            res = fit(self.parts, maps, train, heldout, cfg, progress=False)
            try:
                maps = self.refit(pool)  # at the short fit's selected adapters
            finally:
                res.adapters.detach()
        maps.meta["calibration_rounds"] = rounds
        return maps

    def refit(self, pool: list | None = None) -> FeedbackMaps:
        """One probe at the model's current state (adapters included), pooled with ``pool``."""
        cfg = self.cfg
        return calibrate(
            self.parts, self.probe, self.heldout_probe, feedback_rank=cfg.feedback_rank,
            beta_rel=cfg.beta_rel, feedback_gate=cfg.feedback_gate, probe_synthetic=cfg.probe_synthetic,
            probe_micro_batch=cfg.probe_micro_batch,
            probe_checkpoint=cfg.probe_checkpoint, probe_memory_mb=cfg.probe_memory_mb, pad_id=self.pad_id,
            seed=cfg.seed, pool=pool, progress=self.progress,
        )  # fmt: skip

    def heldout_alignment(self, maps: FeedbackMaps) -> list[float]:
        """Per-block alignment of ``maps`` with the true gradients on the held-out probe at the
        model's current state (one probe backward; a diagnostic)."""
        if not self.heldout_probe:
            raise ValueError("no held-out probe: the alignment diagnostic needs held-out items")
        was_training = self.parts.model.training
        self.parts.model.eval()
        try:
            err, grads = probe_gradients(
                self.parts, self.heldout_probe, self.cfg.probe_micro_batch, self.pad_id,
                recompute=self.cfg.probe_checkpoint, memory_mb=self.cfg.probe_memory_mb,
            )
        finally:
            self.parts.model.train(was_training)
        roles = probe_roles(self.heldout_probe, self.pad_id)
        pairs = zip(maps.factors, grads, strict=True)
        return [
            alignment(f, err.to(f.v.device), g.to(f.v.device), maps.mask(roles.to(f.v.device)))
            for f, g in pairs
        ]
