"""``loca compare``: every method on every task and seed, on identical splits, resumably.

For each task and seed the splits are drawn once and every method sees the same encoded batches
(:class:`~loca.compare.methods.CellData`); each finished cell is stored with its full
configuration (:mod:`loca.compare.store`) and reused only when that configuration matches. A
folder's cells are one comparison: cells of another model, sizes or evaluation settings, and cells
made from other data that this run would not recompute, are refused before any cell runs unless
``overwrite`` (then they are deleted once this comparison has finished).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..config import PRESETS, DataConfig, LocaConfig, ModelConfig, option
from ..data import get_task, load_splits, make_batches
from ..infra import distributed
from ..infra.io import atomic_write_json
from ..infra.memory import PeakMemory
from ..infra.runs import RunFolderError
from ..infra.versions import versions
from ..models.parts import clamp_max_length, find_parts, fingerprint, load_model
from ..pipeline import Pipeline
from .methods import DEFAULT_METHODS, METHODS, VARIANT, CellData, Context, MethodConfigs, get_method
from .report import write_report
from .store import CellStore, digest, scope, scope_difference

DEFAULT_TASKS = ["sst2", "boolq", "arc_easy", "obqa", "hellaswag"]


@dataclass(frozen=True)
class CompareSettings:
    """What a comparison runs: methods × tasks × seeds, and the sizes every cell shares."""

    methods: list[str] = option(DEFAULT_METHODS, f"methods, from {', '.join(METHODS)}")
    tasks: list[str] = option(DEFAULT_TASKS, "tasks (see `loca tasks`)")
    seeds: list[int] = option([0, 1, 2], "seeds: each draws its own splits, A, LoRA init and MeZO noise")
    n_train: int = option(1000, "training examples per cell")
    n_heldout: int = option(250, "held-out examples per cell (selection of every method)")
    n_test: int = option(500, "test examples per cell (0: the whole test split)")
    train_batch_size: int = option(16, "sequences per LoRA / MeZO optimisation step")
    mezo_time_budget: str = option(
        "auto",
        "wall-time budget of each MeZO method in seconds, or 'auto' = LoCA's whole wall time "
        "(calibration and selection included) in the same cell, or 'none'",
    )
    loca_abs_etas: list[float] = option(
        [1.0, 3.0, 10.0], "absolute step candidates of loca-abs (see docs/compare.md)"
    )
    loca_variants: str = option(
        "",
        "extra LoCA configurations, each run as method loca@NAME: a JSON object "
        '{"NAME": {"preset": "paper", "beta_rel": 1.0, ...}} (LoCA settings with an optional preset; '
        "from the strongest: the variant's settings, this run's LoCA flags, the variant's preset, "
        "this run's --preset and --config) or the path of a file holding one",
    )

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        if not self.methods or not self.tasks or not self.seeds:
            raise ValueError("methods, tasks and seeds must not be empty")
        if min(self.n_train, self.n_heldout, self.train_batch_size) < 1 or self.n_test < 0:
            raise ValueError("n_train, n_heldout and train_batch_size must be ≥ 1, n_test ≥ 0")
        if self.mezo_time_budget not in ("auto", "none"):
            try:
                ok = float(self.mezo_time_budget) > 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"mezo_time_budget must be 'auto', 'none' or seconds > 0, got {self.mezo_time_budget!r}"
                )
        if not self.loca_abs_etas or min(self.loca_abs_etas) <= 0:
            raise ValueError("loca_abs_etas must be positive")
        object.__setattr__(self, "_variants", self._parse_variants())  # read once; fails early if malformed

    def variants(self) -> dict[str, dict]:
        """The LoCA variants by name (overrides of the LoCA configuration)."""
        return self._variants

    def _parse_variants(self) -> dict[str, dict]:
        text = self.loca_variants.strip()
        if not text:
            return {}
        if not text.startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as exc:
                raise ValueError(f"loca_variants: cannot read {text!r}: {exc}") from exc
        try:
            variants = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"loca_variants is not valid JSON: {exc}") from exc
        if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
            raise ValueError('loca_variants must map names to objects: {"NAME": {"beta_rel": 1.0}}')
        for name, over in variants.items():
            if not name or not all(c.isalnum() or c in "-_." for c in name):
                raise ValueError(f"loca variant name {name!r}: use letters, digits, '-', '_', '.'")
            if over.get("preset", "default") not in PRESETS:
                raise ValueError(f"loca variant {name}: unknown preset {over['preset']!r}")
            bad = {k for k in over if k != "preset"} - set(LocaConfig().to_dict())
            if bad:
                raise ValueError(f"loca variant {name}: unknown LoCA setting(s) {sorted(bad)}")
            shared = {"max_length", "batch_size", "add_eos"} & set(over)
            if shared:
                raise ValueError(f"loca variant {name}: {sorted(shared)} must be the same for every method")
        return variants


def _ordered(methods: list[str], variants: dict) -> list[str]:
    """Frozen first (every recovery ratio needs it), LoRA next, LoCA and its variants before the
    MeZO methods (their 'auto' time budget is LoCA's wall time), in :data:`METHODS`' order."""
    out = [m for m in METHODS if m in methods or m == "frozen"]
    at = out.index("loca") + 1 if "loca" in out else len(out)
    return out[:at] + [VARIANT + name for name in variants] + out[at:]


def run_compare(
    settings: CompareSettings,
    configs: MethodConfigs,
    *,
    model: ModelConfig,
    out: str | Path,
    data_dir: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Run (or reuse) every cell, then write ``results.json``, ``results.csv``, ``table.md`` and
    the plots under ``out``. Returns the report (see :func:`loca.compare.report.write_report`).

    Cells in ``out`` of another comparison (:data:`~.store.SCOPE`), or made from data that has
    changed since and that this run would not recompute, are refused before any cell runs
    (``RunFolderError``) unless ``overwrite``; then they are deleted once every cell of this run
    has finished. The caller holds ``out``'s lock (:class:`loca.infra.runs.RunLock`)."""
    out = Path(out)
    store = CellStore(out)
    stored = store.stored()  # a file that is not a cell is an error naming it, before the model loads
    start = time.perf_counter()
    tasks = [get_task(t) for t in settings.tasks]
    model_obj, tokenizer = load_model(
        model.model,
        device=distributed.local_device(model.device),
        dtype=model.dtype,
        random_init=model.random_init,
        trust_remote_code=model.trust_remote_code,
        device_map=model.device_map,
    )
    parts = find_parts(model_obj)
    max_length, note = clamp_max_length(configs.loca.max_length, model_obj)
    if note:
        log(f"warning: {note}")
        configs = replace(configs, loca=replace(configs.loca, max_length=max_length))
    base = {
        "model": model.model,
        "fingerprint": fingerprint(parts),
        "dtype": model.dtype,
        **({"device_map": model.device_map} if model.device_map else {}),
        "device_type": parts.device.type,
        "versions": versions(),
        "sizes": {
            "n_train": settings.n_train,
            "n_heldout": settings.n_heldout,
            "n_test": settings.n_test,
            "train_batch_size": settings.train_batch_size,
        },
        "evaluation": {
            "max_length": configs.loca.max_length,
            "batch_size": configs.loca.batch_size,
            "add_eos": configs.loca.add_eos,
        },
    }
    main = distributed.is_main()  # under torchrun: rank 0 writes and logs, every rank computes
    if not main:
        log = _silent
    methods = _ordered(settings.methods, settings.variants())
    pipelines: dict[tuple[str, int], Pipeline] = {}
    data_sha: dict[tuple[str, int], dict] = {}
    for task in tasks:  # every cell's data first: degenerate data is warned about here
        for seed in settings.seeds:
            pipeline = pipelines[(task.name, seed)] = Pipeline(
                model,
                DataConfig(
                    task.name,
                    data_dir=data_dir,
                    n_train=settings.n_train,
                    n_heldout=settings.n_heldout,
                    n_test=settings.n_test,
                ),
                replace(configs.loca, seed=seed),
                progress=False,
                model_object=model_obj,
                tokenizer=tokenizer,
            )
            data_sha[(task.name, seed)] = pipeline.splits.content_sha256()
            distributed.check_same(
                f"data of task {task.name} seed {seed}", digest(data_sha[(task.name, seed)])
            )
    plan = {(t.name, seed, m) for t in tasks for seed in settings.seeds for m in methods}
    replaced = _check_stored(out, stored, base, data_sha, plan, settings, data_dir, overwrite)
    if replaced:
        log(
            f"--overwrite: {len(replaced)} cell(s) in {out} of another comparison or of other data "
            "are deleted once this comparison has finished"
        )
    if main:
        atomic_write_json(
            out / "config.json",
            {
                "command": "compare",
                "model": model.to_dict(),
                "data_dir": data_dir,
                "device": str(parts.device),
                "settings": asdict(settings),
                **configs.to_dict(),
                **base,
                "world_size": distributed.world_size(),
                "distributed": distributed.describe(str(parts.device)),
            },
        )
    counts = {"reused": 0, "run": 0}
    saved: set[Path] = set()
    for task in tasks:
        for seed in settings.seeds:
            pipeline = pipelines.pop((task.name, seed))  # its encoded batches go with the cell
            cell_base = {
                **base,
                "task": task.describe(),
                "seed": seed,
                "splits_sha256": digest(pipeline.splits.record),
                "data_sha256": data_sha[(task.name, seed)],
            }
            data: CellData | None = None
            frozen_ce: float | None = None
            loca_wall: float | None = None
            changed = False
            for method in methods:
                mcfg = _method_config(method, configs, settings, seed, loca_wall)
                key = {**cell_base, "method": method, "config": mcfg}
                cell, why = store.lookup(task.name, seed, method, key)
                if why == "data" and not changed:
                    changed = True
                    log(
                        f"{task.name} seed {seed}: the data changed since its cells were made (the same "
                        "examples by id, other content): recomputing them"
                    )
                if cell is None:
                    if data is None:
                        data = _prepare(pipeline, settings)
                    cell = _run_cell(data, method, mcfg)
                    if main:
                        store.save(task.name, seed, method, key, cell)
                        saved.add(store.path(task.name, seed, method))
                    counts["run"] += 1
                    log(
                        f"{task.name} seed {seed} {method}: test CE {cell['test']['test_ce']:.4f}, "
                        f"acc {cell['test']['acc']:.3f}, {cell['wall_time_s']:.0f} s"
                    )
                else:
                    counts["reused"] += 1
                    log(f"{task.name} seed {seed} {method}: reused")
                fit = cell["fit"]
                if method == "frozen":
                    frozen_ce = fit["heldout_ce"]
                elif frozen_ce is not None and not _close(fit["frozen_heldout_ce"], frozen_ce):
                    raise RuntimeError(
                        f"{task.name} seed {seed} {method}: the frozen model's held-out CE was "
                        f"{fit['frozen_heldout_ce']} before this method but {frozen_ce} in the frozen "
                        "cell; an earlier method left the model modified"
                    )
                if method == "loca":  # MeZO's 'auto' budget: rank 0's clock, the same key everywhere
                    loca_wall = distributed.from_main(fit["wall_time_s"])
    log(f"cells: {counts['run']} run, {counts['reused']} reused ({time.perf_counter() - start:.0f} s)")
    if main and replaced:
        gone = [path for path in replaced if path not in saved]
        for path in gone:
            path.unlink(missing_ok=True)
        for folder in sorted({p.parent for p in gone} | {p.parent.parent for p in gone}, reverse=True):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        log(f"--overwrite: deleted {len(gone)} cell(s) of another comparison or of other data")
    distributed.barrier()
    return write_report(out, store.report_cells()) if main else {}


def _check_stored(
    out: Path,
    stored: list[tuple[Path, dict]],
    base: dict,
    data_sha: dict[tuple[str, int], dict],
    plan: set[tuple[str, int, str]],
    settings: CompareSettings,
    data_dir: str | None,
    overwrite: bool,
) -> list[Path]:
    """The stored cells this comparison may not mix with: cells of another scope (model, sizes,
    evaluation settings), and cells of this run's tasks made from other data than the task's files
    hold now that this run does not recompute (another seed or method). Raises
    :class:`RunFolderError` naming one and what to do, unless ``overwrite``: then returns their
    paths (to delete once this comparison has finished)."""
    ours = scope(base)
    foreign = [(path, cell) for path, cell in stored if scope(cell["key"]) != ours]
    names = {task for task, _ in data_sha}
    stale = []
    for path, cell in stored:
        old = cell["key"].get("data_sha256")
        where = (cell["task"], cell["seed"])
        if old is None or cell["task"] not in names or (*where, cell["method"]) in plan:
            continue  # an older cell, another task, or a cell this run recomputes if it must
        if scope(cell["key"]) != ours:
            continue
        if where not in data_sha:  # a seed this run does not draw: its data as the files hold it now
            try:
                splits = load_splits(
                    cell["task"],
                    n_train=settings.n_train,
                    n_heldout=settings.n_heldout,
                    n_test=settings.n_test,
                    seed=cell["seed"],
                    data_dir=data_dir,
                )
                data_sha[where] = splits.content_sha256()
            except (ValueError, OSError):  # the files cannot make this cell's splits any more
                data_sha[where] = {}
        if old != data_sha[where]:
            stale.append((path, cell))
    if overwrite:
        return [path for path, _ in foreign + stale]
    if foreign:
        path, cell = foreign[0]
        raise RunFolderError(
            f"--out {out} holds {len(foreign)} cell(s) of another comparison "
            f"({scope_difference(ours, scope(cell['key']))}; e.g. {path.relative_to(out)}): choose "
            "another --out, or pass --overwrite to replace them (deleted once this comparison has finished)"
        )
    if stale:
        path, cell = stale[0]
        raise RunFolderError(
            f"--out {out} holds {len(stale)} cell(s) made from other data than the task's files hold "
            f"now (the same examples by id, other content; e.g. {path.relative_to(out)}) that this run "
            "would not recompute: add their seeds and methods to this run, or pass --overwrite to "
            "delete them once this comparison has finished"
        )
    return []


def _silent(message: str) -> None:
    pass


def _close(a: float, b: float) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


def _method_config(
    method: str, configs: MethodConfigs, s: CompareSettings, seed: int, loca_wall: float | None
) -> dict:
    """The resolved configuration of one method in one cell (part of its key)."""
    return get_method(method).config(Context(configs, s, seed, loca_wall))


def _prepare(pipeline: Pipeline, s: CompareSettings) -> CellData:
    """The cell's data, encoded and batched by the pipeline (as `loca fit` does)."""
    train_items, heldout_items = pipeline.encoded()
    train, heldout = pipeline.batched()
    return CellData(
        parts=pipeline.parts,
        tokenizer=pipeline.tokenizer,
        task=pipeline.task,
        splits=pipeline.splits,
        train_items=train_items,
        heldout_items=heldout_items,
        train=train,
        heldout=heldout,
        minibatches=make_batches(train_items, pipeline.pad_id, s.train_batch_size),
        pad_id=pipeline.pad_id,
        seed=pipeline.cfg.seed,
        pipeline=pipeline,
    )


def _run_cell(data: CellData, method: str, mcfg: dict) -> dict:
    record = get_method(method)
    start = time.perf_counter()
    with PeakMemory(data.parts.device) as mem:
        result, cleanup = record.run(data, record.settings(mcfg), method)
    try:
        t0 = time.perf_counter()
        test = data.pipeline.evaluate()  # the test split, with the run's max_length, batch and EOS
        eval_s = time.perf_counter() - t0
    finally:
        cleanup()
    return {
        "task": data.task.name,
        "seed": data.seed,
        "method": method,
        "fit": result.to_dict(),
        "test": test,
        "peak_memory_mb": mem.peak_mb,
        "memory_kind": mem.kind,
        "eval_wall_time_s": eval_s,
        "wall_time_s": time.perf_counter() - start,
        "device": str(data.parts.device),
    }
