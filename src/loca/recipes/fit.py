"""Calibrate (or load maps), fit LoCA adapters forward-only, and compare with the frozen model.

Example (the README's main job)::

    loca fit --model smollm2-135m-instruct --task sst2 --n-train 128 --n-heldout 64 --out runs/sst2

``--out DIR`` receives ``config.json`` (everything needed to rerun), ``history.jsonl`` (one row
per candidate and iteration), ``results.json`` (frozen vs LoCA metrics, the selection, alignment),
``adapter/`` (the selected adapters, updated atomically whenever the held-out CE improves) and
``maps/`` (the feedback maps, unless ``--maps`` loaded them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from ..adapters import CONFIG_NAMES, ResidualAdapters
from ..calibrate import MAPS_CONFIG, Calibrator, FeedbackMaps
from ..data import padding_fraction
from ..data.encoding import count_truncated
from ..evaluation import evaluate
from ..fit import fit
from ..io import atomic_write_json, atomic_write_text, is_artefact
from ..models import fingerprint
from ..runs import prepare_run_dir, require_finite, run_command
from ..versions import versions
from .common import add_config_args, add_data_args, add_model_args, refuse_flags, setup_run, warn


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_data_args(p, n_train=128, n_heldout=64, n_test=200)
    add_config_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--maps", default=None, help="load feedback maps from this folder instead of calibrating")
    g.add_argument("--out", default=None, help="output folder (config, history, results, adapter, maps)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier `loca fit` run in --out, or add this run's "
                   "files to a non-empty folder (nothing else there is deleted)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    out = Path(args.out) if args.out else None
    if args.maps:
        refuse_flags(args, STAGE_I, "configure calibration and do not apply with --maps (the maps are "
                     "already calibrated); drop them or calibrate again")  # fmt: skip
    if out:
        rerun = run_command(out) == "fit"
        prepare_run_dir(out, "fit", model=args.model, overwrite=args.overwrite, writes=WRITES)
        if rerun:
            _clear_previous_run(out)
    run = setup_run(args)
    cfg, task, splits, parts, tokenizer = run.cfg, run.task, run.splits, run.parts, run.tokenizer
    maps = FeedbackMaps.from_pretrained(args.maps, parts) if args.maps else None
    if maps is not None:  # record what calibrated the maps, not the flags' defaults
        cfg = replace(cfg, feedback_rank=maps.rank, beta_rel=maps.meta.get("beta_rel", cfg.beta_rel))
    train_items, heldout_items = run.encode(splits.train), run.encode(splits.heldout)
    train, heldout = run.batches(train_items), run.batches(heldout_items)
    truncated = {
        "train": count_truncated(tokenizer, task, splits.train, train_items),
        "heldout": count_truncated(tokenizer, task, splits.heldout, heldout_items),
    }
    for name, n in truncated.items():
        if n:
            total = len(train_items if name == "train" else heldout_items)
            warn(f"{n} of {total} {name} prompts were cut from the left to fit --max-length "
                 f"{cfg.max_length}; their question may be lost")  # fmt: skip

    run_config = {
        "command": "fit",
        "model": args.model,
        "dtype": args.dtype,
        "device": str(parts.device),
        "task": task.describe(),
        "data_dir": run.data_dir,
        "splits": splits.record,
        "loca": cfg.to_dict(),
        "maps": args.maps,
        "fingerprint": fingerprint(parts),
        "versions": versions(),
    }
    if out:
        atomic_write_json(out / "config.json", run_config)

    calibrator = Calibrator(parts, train_items, heldout_items, cfg, run.pad_id, progress=not args.quiet)
    if maps is None:
        t0 = time.perf_counter()
        maps = calibrator.calibrate()
        maps.meta["calibration_time_s"] = time.perf_counter() - t0
        if out:
            maps.save_pretrained(out / "maps")
    align = maps.meta.get("alignment", {})
    if align:
        print(
            f"calibration: alignment probe {_range(align['probe'])}, held-out "
            f"{_range(align.get('heldout', []))}, random map {_range(align['random'])}"
        )

    history_lines: list[str] = []

    def on_iteration(row: dict) -> None:
        history_lines.append(json.dumps(row))
        if out:
            atomic_write_text(out / "history.jsonl", "\n".join(history_lines) + "\n")

    def on_improve(adapters: ResidualAdapters, row: dict) -> None:
        if out:
            adapters.save_pretrained(out / "adapter", extra={"selection": row, "task": task.name})

    result = fit(
        parts, maps, train, heldout, cfg, calibrator=calibrator, on_iteration=on_iteration,
        on_improve=on_improve, progress=not args.quiet,
    )  # fmt: skip
    if cfg.max_iters == 0:
        print("LoCA: --max-iters 0 runs no Stage II iteration; returning the frozen model (B = 0)")
    elif not result.improved:
        print("LoCA: no candidate beat the frozen model on held-out CE; returning the frozen model (B = 0)")
        if out:
            result.adapters.save_pretrained(out / "adapter", extra={"selection": None, "task": task.name})

    ev = dict(max_length=cfg.max_length, batch_size=cfg.batch_size, add_eos=cfg.add_eos,
              progress=not args.quiet)  # fmt: skip
    loca_test = evaluate(parts, tokenizer, task, splits.test, **ev)
    result.adapters.detach()
    frozen_test = evaluate(parts, tokenizer, task, splits.test, **ev)
    result.adapters.attach()

    results = {
        "task": task.name,
        "model": args.model,
        "frozen": _row(result.frozen_heldout_ce, frozen_test),
        "loca": _row(result.heldout_ce, loca_test),
        "eta": result.eta,
        "lam": result.lam_rel,
        "best_iteration": result.best_iteration,
        "improved": result.improved,
        "stop_reasons": result.stop_reasons,
        "recalibrations": result.recalibrations,
        "recalibration_time_s": result.recalibration_time_s,
        "alignment": align,
        "padding_fraction": {"train": padding_fraction(train), "heldout": padding_fraction(heldout)},
        "truncated_prompts": {**truncated, "test": loca_test["n_truncated"]},
        "fit_wall_time_s": result.wall_time_s,
        "wall_time_s": time.perf_counter() - start,
    }
    _print_table(results)
    for name in ("frozen", "loca"):
        require_finite(results[name], f"the {name} model's evaluation")
    if out:
        atomic_write_json(out / "results.json", results)
    else:
        print("no --out given: the adapters and maps were not saved")
    return 0


WRITES = ("config.json", "history.jsonl", "results.json", "adapter", "maps")
# LoCA flags that only calibration uses (refused with --maps)
STAGE_I = {"feedback_rank", "beta_rel", "probe_positions", "probe_micro_batch", "calibration_rounds",
           "calibration_round_iters"}  # fmt: skip


def _clear_previous_run(out: Path) -> None:
    """Remove an earlier fit's results from ``out`` (after --overwrite), so that a failed rerun
    never leaves a config describing another run than the results beside it."""
    for name in ("results.json", "history.jsonl", "config.json"):
        (out / name).unlink(missing_ok=True)
    for sub, cfg_file, fmt in (("adapter", CONFIG_NAMES, "loca-adapter"),
                               ("maps", MAPS_CONFIG, "loca-feedback-maps")):  # fmt: skip
        if is_artefact(out / sub, cfg_file, fmt):
            shutil.rmtree(out / sub)


def _row(heldout_ce: float, test: dict) -> dict:
    return {
        "heldout_ce": heldout_ce,
        "test_ce": test["test_ce"],
        "test_ce_no_eos": test["test_ce_no_eos"],
        "test_acc": test["acc"],
        "test_acc_norm": test["acc_norm"],
        "n_test": test["n_test"],
    }


def _range(xs: list[float]) -> str:
    return f"{min(xs):+.2f}..{max(xs):+.2f}" if xs else "n/a"


def _print_table(r: dict) -> None:
    cols = ["heldout_ce", "test_ce", "test_ce_no_eos", "test_acc", "test_acc_norm"]
    eta = "none" if r["eta"] is None else f"{r['eta']:.3g}"
    sel = f"eta={eta} lam_rel={r['lam']} best_iteration={r['best_iteration']}"
    print(f"\n{r['task']} on {r['model']}: {sel}")
    print(f"{'':8}" + "".join(f"{c:>16}" for c in cols))
    for name in ("frozen", "loca"):
        print(f"{name:8}" + "".join(f"{r[name][c]:>16.4f}" for c in cols))
    print(f"wall time {r['wall_time_s']:.1f} s")
