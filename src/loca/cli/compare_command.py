"""Compare LoCA with the frozen model, LoRA (PEFT), Adapter-BP and MeZO on identical splits, side by side.

Example (the committed SmolLM2 comparison, see docs/compare.md)::

    loca compare --model smollm2-135m-instruct --tasks sst2 boolq arc_easy obqa hellaswag \\
        --seeds 0 1 2 --out runs/compare-smollm2

``--out DIR`` receives ``cells/<task>/seed<k>/<method>.json`` (one per finished cell, with its
full configuration), ``config.json``, ``results.json`` and ``results.csv`` (one row per method ×
task × seed), ``table.md`` (mean ± spread over seeds, R_CE and R_acc against LoRA, R_ceiling
against Adapter-BP) and the plots
``heldout_vs_time.png``, ``heldout_vs_steps.png``, ``accuracy.png``. Rerunning the same command
reuses every finished cell whose configuration matches and runs the rest (cells whose data
changed under the same ids are recomputed); ``--report-only`` redraws the tables and plots from
the stored cells without loading a model.

A folder holds one comparison: cells of another model, sizes or evaluation settings (or made from
other data, and not recomputed by this run) are refused unless ``--overwrite``, which replaces
them once the new comparison has finished; ``--report-only`` refuses a folder that mixes them.
One process at a time: ``compare`` locks its folder, and a second one on it is refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compare import CompareSettings, MethodConfigs, run_compare
from ..compare.methods import LOCA, baseline_options
from ..compare.report import headline, write_report
from ..compare.store import CellStore
from ..infra import distributed
from ..infra.runs import RunFolderError, RunLock, prepare_run_dir, run_command
from .args import (
    add_config_args,
    add_dataclass_args,
    add_model_args,
    add_output_args,
    config_from_args,
    dataclass_from_args,
    given_loca_flags,
    model_config_from_args,
    resolve_data_dir,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument(
        "--data-dir", default=None, help="folder of task folders (default: $LOCA_DATA_DIR, else the HF hub)"
    )
    p.add_argument("--out", required=True, help="comparison folder (resumable)")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="only redraw results/tables/plots from the cells stored in --out",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the cells in --out of another comparison (another model, sizes or evaluation "
        "settings, or other data); they are deleted once this comparison has finished",
    )
    add_dataclass_args(p, CompareSettings, title="comparison")
    add_config_args(p, skip=LOCA.skip)
    for o in baseline_options():  # the methods' settings (compare.methods.REGISTRY)
        add_dataclass_args(p, o.cls, title=o.title, prefix=o.prefix, skip=o.skip)
    add_output_args(p)


def method_configs(args: argparse.Namespace) -> MethodConfigs:
    """Every method's settings from the flags."""
    return MethodConfigs(
        loca=config_from_args(args),
        baselines={o.key: dataclass_from_args(o.cls, args, o.prefix) for o in baseline_options()},
        loca_flags=frozenset(given_loca_flags(args)),
    )


WRITES = (  # what compare writes in --out (compare.plots.FILES last)
    "cells",
    "config.json",
    "results.json",
    "results.csv",
    "table.md",
    "heldout_vs_time.png",
    "heldout_vs_steps.png",
    "accuracy.png",
)


def run(args: argparse.Namespace) -> int:
    if args.report_only:
        if not distributed.is_main():
            return 0
        if run_command(Path(args.out)) != "compare" and not (Path(args.out) / "cells").is_dir():
            raise ValueError(f"--out {args.out} is not a `loca compare` folder")
        with RunLock(args.out, "compare"):
            cells = CellStore(args.out).report_cells()  # refused if they mix comparisons
            if not cells:
                raise ValueError(f"{args.out} holds no finished cells")
            write_report(args.out, cells)
        print(f"wrote the report of {len(cells)} cells to {args.out}")
        return 0
    settings = dataclass_from_args(CompareSettings, args)
    model = model_config_from_args(args)
    lock = RunLock(args.out, "compare")
    problem = None
    if distributed.is_main():  # the folder is checked, then locked, by rank 0; every rank hears
        try:
            prepare_run_dir(
                args.out,
                "compare",
                model=model.model,
                resumable=True,
                overwrite=args.overwrite,
                writes=WRITES,
            )
            lock.acquire()
        except RunFolderError as exc:
            problem = str(exc)
    problem = distributed.broadcast_from_main(problem)
    if problem:
        raise RunFolderError(problem)
    try:
        report = run_compare(
            settings,
            method_configs(args),
            model=model,
            out=args.out,
            data_dir=resolve_data_dir(args.data_dir),
            overwrite=args.overwrite,
        )
    finally:
        lock.release()
    if not distributed.is_main():
        return 0
    print(open(f"{args.out}/table.md").read())
    head = report["summary"].get("loca_vs_lora")
    if head:
        print(headline(head))
    return 0
