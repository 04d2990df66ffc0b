"""Calibrate (or load maps), fit LoCA adapters forward-only, and compare with the frozen model.

Example (the README's main job)::

    loca fit --model smollm2-135m-instruct --task sst2 --data-dir data --out runs/sst2

``--out DIR`` receives ``config.json`` (the model, data and loca sections: ``loca fit --config
DIR/config.json`` reruns it), ``history.jsonl`` (one row per candidate and iteration),
``results.json`` (frozen vs LoCA metrics, the selection, alignment), ``adapter/`` (the selected
adapters, updated atomically whenever the held-out CE improves), ``maps/`` (the feedback maps,
unless ``--maps`` loaded them) and, while the fit runs, ``checkpoint/``: ``loca fit --resume --out
DIR`` continues an interrupted run from its last completed iteration to the same result.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from ..config import DataConfig, LocaConfig, ModelConfig
from ..infra import distributed
from ..pipeline import Pipeline
from .args import (
    add_config_args,
    add_data_args,
    add_model_args,
    add_output_args,
    pipeline_from_args,
    refuse_flags,
    section_fields,
)

DATA_DEFAULTS = dict(n_train=128, n_heldout=64, n_test=200)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_data_args(p, **DATA_DEFAULTS)
    add_config_args(p, notes={"calibration": "not with --maps (the maps are calibrated already)"})
    g = p.add_argument_group("run")
    g.add_argument(
        "--maps",
        default=None,
        help="load feedback maps (from `loca calibrate`) instead of calibrating: the fit "
        "then runs with autograd disabled",
    )
    g.add_argument("--out", default=None, help="output folder (config, history, results, adapter, maps)")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier `loca fit` run in --out (only once this run has "
        "finished: if it fails, the earlier run stays), or add this run's files to a non-empty "
        "folder (nothing else there is deleted)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --out from its last completed iteration, "
        "with the settings of its config.json (no other settings may be given; "
        "--trust-remote-code must be given again if the run used it), on the same data only",
    )
    add_output_args(p)


# flags that --resume refuses: the run's own config.json gives every setting (but
# trust_remote_code, which is only ever taken from the command line)
_SETTINGS = (
    *(f.name for f in fields(ModelConfig) if f.name != "trust_remote_code"),
    *(f.name for f in fields(DataConfig)),
    "maps",
    "config",
    "preset",
    "overwrite",
)


def run(args: argparse.Namespace) -> int:
    progress = not args.quiet
    if args.resume:
        why = "cannot be given with --resume: the run continues with its config.json's settings"
        refuse_flags(args, {f.name for f in fields(LocaConfig)}, why)
        given = [n for n in _SETTINGS if getattr(args, n, None) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join('--' + n.replace('_', '-') for n in given)} {why}")
        if not args.out:
            raise ValueError("--resume needs --out, the folder of the run to continue")
        remote = getattr(args, "trust_remote_code", False)
        pipeline = Pipeline.from_run(args.out, trust_remote_code=remote, progress=progress)
        results = pipeline.run(args.out, resume=True)
    else:
        if args.maps:
            refuse_flags(
                args,
                section_fields("calibration"),
                "configure calibration and do not "
                "apply with --maps (the maps are already calibrated); drop them or calibrate "
                "again",
            )
        pipeline = pipeline_from_args(args, **DATA_DEFAULTS)
        results = pipeline.run(args.out, maps=args.maps, overwrite=args.overwrite)
    if distributed.is_main():
        print_results(results)
        if not args.out:
            print("no --out given: the adapters and maps were not saved")
    return 0


def print_results(r: dict) -> None:
    cols = ["heldout_ce", "test_ce", "test_ce_no_eos", "test_acc", "test_acc_norm"]
    eta = "none" if r["eta"] is None else f"{r['eta']:.3g}"
    sel = f"eta={eta} lam_rel={r['lam_rel']} best_iteration={r['best_iteration']}"
    print(f"\n{r['task']} on {r['model']}: {sel}")
    print(f"{'':8}" + "".join(f"{c:>16}" for c in cols))
    for name in ("frozen", "loca"):
        print(f"{name:8}" + "".join(f"{r[name][c]:>16.4f}" for c in cols))
    print(f"wall time {r['wall_time_s']:.1f} s")
