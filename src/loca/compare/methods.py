"""The comparison's methods: one :class:`Method` record each in :data:`REGISTRY` (its name,
label, colour, settings and flags, how one cell configures and runs it), and the run functions:
fit one method on one prepared task split, leave the model in its selected state, and hand back
the result and how to return the model to its frozen state.

Every method sees the same :class:`CellData`: the same examples, encoded once, batched by one
path (:func:`loca.data.batching.make_batches`), the same held-out batches for selection.
Everything else that names a method (``--methods`` and its default, the flags, ``table.md``'s
labels, the plots' colours, R_ceiling's reference) reads :data:`REGISTRY`; adding a method is
one record here (docs/compare.md, "Adding a method").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..baselines.adapter_bp import AdapterBpSettings
from ..baselines.common import HeldoutSelector, MethodResult
from ..baselines.lora import LoraSettings
from ..baselines.mezo import MezoSettings
from ..config import PRESETS, LocaConfig
from ..data import Batch, Encoded, Splits, Task
from ..method import run as method_run
from ..method.calibrate import Calibrator
from ..models.parts import ModelParts


@dataclass
class CellData:
    """A task's splits on one seed, encoded and batched for every method."""

    parts: ModelParts
    tokenizer: object
    task: Task
    splits: Splits
    train_items: list[Encoded]
    heldout_items: list[Encoded]
    train: list[Batch]  # LoCA's passes (batch_size sequences each)
    heldout: list[Batch]  # held-out selection, every method
    minibatches: list[Batch]  # LoRA / MeZO optimisation steps (train_batch_size sequences each)
    pad_id: int
    seed: int
    pipeline: object  # the loca.pipeline.Pipeline that drew and encoded the data (evaluation)


Outcome = tuple[MethodResult, Callable[[], None]]


def run_frozen(cell: CellData, settings: None = None, method: str = "frozen") -> Outcome:
    """The unmodified model: its held-out CE is every method's starting point."""
    sel = HeldoutSelector(cell.parts, cell.heldout, snapshot=lambda: None, restore=lambda s: None)
    sel.evaluate(None, 0)
    return sel.result(method, "none"), lambda: None


def run_loca(cell: CellData, cfg: LocaConfig, method: str = "loca") -> Outcome:
    """Calibration (one probe backward pass) then the forward-only fit, with its η/λ selection.

    Times count from the start of calibration, so LoCA's wall time includes Stage I."""
    start = time.perf_counter()
    calibrator = Calibrator(cell.parts, cell.train_items, cell.heldout_items, cfg, cell.pad_id)
    run = method_run.run_loca(cell.parts, calibrator, cell.train, cell.heldout, cfg, progress=False)
    maps, res = run.maps, run.result
    calib_s = time.perf_counter() - start - (run.wall_time_s - run.calibration_s)
    rows = [r for r in res.history if "diagnostic" not in r and r["heldout_ce"] is not None]
    history = [
        {
            "candidate": None if r["eta"] is None else {"eta": r["eta"], "lam_rel": r["lam_rel"]},
            "step": r["iteration"],
            "heldout_ce": r["heldout_ce"],
            "elapsed_s": calib_s + r["elapsed_s"],
            "train_ce": r["train_ce"],
            "b_norm": r["b_norm"],
        }
        for r in rows
    ]
    best = min(history, key=lambda h: h["heldout_ce"])  # the first row at the lowest CE: fit's pick
    result = MethodResult(
        method=method,
        frozen_heldout_ce=res.frozen_heldout_ce,
        heldout_ce=res.heldout_ce,
        selected={"eta": res.eta, "lam_rel": res.lam_rel} if res.improved else {},
        best_step=res.best_iteration,
        step_unit="iteration",
        improved=res.improved,
        time_to_best_s=best["elapsed_s"] if res.improved else calib_s,
        wall_time_s=time.perf_counter() - start,
        history=history,
        extra={
            "calibration_time_s": calib_s,
            "alignment": maps.meta.get("alignment", {}),
            "stop_reasons": res.stop_reasons,
            "b_norm": res.adapters.norm(),
            "step_scale": cfg.step_scale,
            "recalibrations": res.recalibrations,
            "recalibration_time_s": res.recalibration_time_s,
            "alignment_during_fit": [
                {"iteration": r["iteration"], "median": r["median"], "per_block": r["alignment"]}
                for r in res.history
                if r.get("diagnostic") == "heldout_alignment"
            ],
        },
    )
    return result, res.adapters.detach


def run_lora(cell: CellData, settings, method: str = "lora") -> Outcome:
    """LoRA; ``lora-paper`` is the same fit with the paper's settings, kept at its last iterate."""
    from ..baselines.lora import fit_lora

    run = fit_lora(cell.parts, cell.minibatches, cell.heldout, settings, progress=False)
    return replace(run.result, method=method), run.unload


def run_adapter_bp(cell: CellData, settings, method: str = "adapter-bp") -> Outcome:
    """LoCA's adapters (its A for this seed; a principal A from LoCA's own batches) with B trained
    by backpropagation on the minibatches."""
    from ..baselines.adapter_bp import fit_adapter_bp
    from ..method.a_init import principal_a
    from ..method.adapters import ResidualAdapters

    a = None
    if settings.a_init == "principal":
        a = principal_a(cell.parts, cell.train, settings.rank, settings.seed)
    adapters = ResidualAdapters(cell.parts, rank=settings.rank, seed=settings.seed, a=a)
    try:
        run = fit_adapter_bp(
            cell.parts, cell.minibatches, cell.heldout, settings, adapters=adapters, progress=False
        )
    except BaseException:
        adapters.detach()
        raise
    return replace(run.result, method=method), run.restore


def run_adapter_mezo(cell: CellData, settings, method: str = "adapter-mezo") -> Outcome:
    """The result keeps the name the MeZO fit gives it (``adapter_mezo``)."""
    from ..baselines.mezo import fit_adapter_mezo

    run = fit_adapter_mezo(cell.parts, cell.minibatches, cell.heldout, settings, progress=False)
    return run.result, run.restore


def run_mezo(cell: CellData, settings, method: str = "mezo") -> Outcome:
    from ..baselines.mezo import fit_mezo

    run = fit_mezo(cell.parts, cell.minibatches, cell.heldout, settings, progress=False)
    return run.result, run.restore


# --- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """A settings class and the flags that fill it, shared by the methods configured from it
    (``lora`` and ``lora-paper`` from LoRA's settings, for example)."""

    key: str  # its entry in MethodConfigs and its section of the comparison's config.json
    cls: type
    prefix: str | None  # flags --PREFIX-FIELD; None: the run's own LoCA flags (with --preset, --config)
    title: str = ""  # the flags' group in --help
    skip: tuple[str, ...] = ("seed",)  # fields without a flag: each cell sets them (seed from --seeds)


LOCA = Options("loca", LocaConfig, None)
# LoRA's `select` is off only in the lora-paper method.
LORA = Options("lora", LoraSettings, "lora", "LoRA", skip=("seed", "select"))
# Adapter-BP trains LoCA's adapters: rank and A from the LoCA flags; the credit from the method
# name (adapter-bp: all positions, adapter-bp-predict: the predict positions).
ADAPTER_BP = Options(
    "adapter_bp", AdapterBpSettings, "adapter-bp", "Adapter-BP", skip=("seed", "rank", "a_init", "credit")
)
# MeZO's time budget comes from --mezo-time-budget and Adapter-MeZO's adapter rank from --rank (it
# perturbs the same adapters LoCA fits).
_MEZO_SKIP = ("seed", "time_budget_s", "rank")
ADAPTER_MEZO = Options("adapter_mezo", MezoSettings, "mezo", "Adapter-MeZO", skip=_MEZO_SKIP)
MEZO = Options("mezo", MezoSettings, "full-mezo", "full MeZO", skip=_MEZO_SKIP)


@dataclass
class MethodConfigs:
    """The settings the methods are configured from: ``loca``, the run's LoCA configuration, and
    ``baselines`` by :attr:`Options.key` (``lora``, ``adapter_bp``, ``adapter_mezo``, ``mezo``; one
    left out or None takes its class's defaults). ``loca_flags``: the LoCA fields the run gave
    explicitly (its flags), which a variant's preset does not override."""

    loca: LocaConfig
    baselines: dict[str, Any] = field(default_factory=dict)
    loca_flags: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.baselines) - {o.key for o in baseline_options()}
        if unknown:
            raise ValueError(f"unknown method settings {sorted(unknown)}")

    def of(self, options: Options):
        """The settings of ``options`` as the run gives them (before a cell's own fields)."""
        if options is LOCA:
            return self.loca
        return self.baselines.get(options.key) or options.cls()

    def to_dict(self) -> dict:
        """Every section, LoCA's first (the comparison's config.json)."""
        return {"loca": self.loca.to_dict(), **{o.key: self.of(o).to_dict() for o in baseline_options()}}


@dataclass(frozen=True)
class Context:
    """What a method's configuration in one cell may depend on."""

    configs: MethodConfigs
    compare: Any  # the CompareSettings (mezo_time_budget, loca_abs_etas, variants)
    seed: int
    loca_wall: float | None  # LoCA's wall time in this cell (None: not run, or not yet)


@dataclass(frozen=True)
class Method:
    """One comparison method: everything that names it reads this record."""

    name: str  # --methods, cells/<task>/seed<k>/<name>.json, the rows of results.csv
    label: str  # its column in table.md
    color: str  # its curves and bars in the plots (a matplotlib colour)
    run: Callable[[CellData, Any, str], Outcome]  # (cell data, its settings, its name)
    options: Options | None = None  # the settings it is configured from (None: none)
    # (method, context) -> the resolved settings of one cell, as a dict: part of the cell's key
    configure: Callable[[Method, Context], dict] | None = None
    preset: Mapping[str, Any] = field(default_factory=dict, hash=False)  # fixed settings of this method
    default: bool = False  # in --methods' default
    ceiling: int = 0  # R_ceiling's reference when its cell exists: 1 first choice, 2 next; 0 never
    r_ceiling: bool = False  # gets an R_ceiling (LoCA's configurations)

    def config(self, context: Context) -> dict:
        """The resolved configuration of this method in one cell (part of its key)."""
        return {} if self.configure is None else self.configure(self, context)

    def settings(self, config: dict):
        """The settings object a cell's resolved configuration stands for (None: no settings)."""
        return None if self.options is None else self.options.cls.from_dict(config)


def _loca(m: Method, c: Context) -> dict:
    return replace(c.configs.loca, seed=c.seed, **m.preset).to_dict()


def _loca_abs(m: Method, c: Context) -> dict:
    return replace(c.configs.loca, seed=c.seed, etas=list(c.compare.loca_abs_etas), **m.preset).to_dict()


def _loca_variant(m: Method, c: Context) -> dict:
    """A LoCA variant. From the strongest: the variant's own keys, the run's LoCA flags, the
    variant's preset, the run's preset and config file, the defaults."""
    over = dict(c.compare.variants()[m.name.removeprefix(VARIANT)])
    preset = PRESETS[over.pop("preset", "default")]
    run = c.configs.loca.to_dict()  # the run's preset, config file and flags over the defaults
    flags = {k: run[k] for k in c.configs.loca_flags}
    return LocaConfig(**{**run, **preset, **flags, **over, "seed": c.seed}).to_dict()


def _lora(m: Method, c: Context) -> dict:
    cfg = replace(c.configs.of(m.options), seed=c.seed, **m.preset).to_dict()
    if cfg["select"]:
        del cfg["select"]  # the default: the keys of LoRA cells stored before the field existed match
    return cfg


def _adapter_bp(m: Method, c: Context) -> dict:
    """LoCA's adapters: its rank and A."""
    loca = c.configs.loca
    return replace(
        c.configs.of(m.options), seed=c.seed, rank=loca.rank, a_init=loca.a_init, **m.preset
    ).to_dict()


def _mezo_budget(c: Context) -> float | None:
    if c.compare.mezo_time_budget == "none":
        return None
    if c.compare.mezo_time_budget == "auto":
        return c.loca_wall  # None when LoCA is not in the comparison: the step budget alone
    return float(c.compare.mezo_time_budget)


def _adapter_mezo(m: Method, c: Context) -> dict:
    """The same adapters as LoCA's."""
    own = c.configs.of(m.options)
    return replace(own, seed=c.seed, time_budget_s=_mezo_budget(c), rank=c.configs.loca.rank).to_dict()


def _mezo(m: Method, c: Context) -> dict:
    return replace(c.configs.of(m.options), seed=c.seed, time_budget_s=_mezo_budget(c)).to_dict()


# In this order the methods run in a cell, and appear in the report and plots (LoCA's variants,
# loca@NAME, right after loca).
REGISTRY: dict[str, Method] = {
    m.name: m
    for m in [
        Method("frozen", "Frozen", "0.4", run_frozen, default=True),
        Method("lora", "LoRA", "C0", run_lora, LORA, _lora, default=True),
        # the paper's LoRA protocol (one lr, 3 epochs, no selection: the last iterate); the other
        # LoRA settings (rank, alpha, modules, clipping, evaluation points) are --lora-*'s.
        Method(
            "lora-paper",
            "LoRA (paper)",
            "navy",
            run_lora,
            LORA,
            _lora,
            preset={"lrs": [2e-4], "epochs": 3, "select": False},
        ),
        Method("loca", "LoCA", "C3", run_loca, LOCA, _loca, default=True, r_ceiling=True),
        Method(
            "loca-abs",
            "LoCA (abs η)",
            "C1",
            run_loca,
            LOCA,
            _loca_abs,
            preset={"step_scale": "absolute"},
            r_ceiling=True,
        ),
        Method(
            "adapter-bp",
            "Adapter-BP",
            "darkred",
            run_adapter_bp,
            ADAPTER_BP,
            _adapter_bp,
            preset={"credit": "all"},
            ceiling=2,
        ),
        Method(
            "adapter-bp-predict",
            "Adapter-BP (predict)",
            "lightcoral",
            run_adapter_bp,
            ADAPTER_BP,
            _adapter_bp,
            preset={"credit": "predict"},
            ceiling=1,
        ),
        Method(
            "adapter-mezo", "Adapter-MeZO", "C2", run_adapter_mezo, ADAPTER_MEZO, _adapter_mezo, default=True
        ),
        Method("mezo", "MeZO", "C4", run_mezo, MEZO, _mezo),
    ]
}
METHODS = tuple(REGISTRY)
DEFAULT_METHODS = [m.name for m in REGISTRY.values() if m.default]
# R_ceiling's reference: the first of these whose cell exists
CEILINGS = tuple(m.name for m in sorted(REGISTRY.values(), key=lambda m: m.ceiling) if m.ceiling)
VARIANT = "loca@"  # loca@NAME: LoCA with a variant's settings (--loca-variants)


def baseline_options() -> list[Options]:
    """The settings with flags of their own, in the order of the methods that use them."""
    return list(dict.fromkeys(m.options for m in REGISTRY.values() if m.options not in (None, LOCA)))


def lookup(name: str) -> Method | None:
    """The record of a method (a variant's: LoCA's, configured from the variant); None if unknown."""
    if name.startswith(VARIANT):
        return replace(REGISTRY["loca"], name=name, label=name, configure=_loca_variant, default=False)
    return REGISTRY.get(name)


def get_method(name: str) -> Method:
    method = lookup(name)
    if method is None:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return method
