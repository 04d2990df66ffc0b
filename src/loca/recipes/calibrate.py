"""Stage I only: calibrate the feedback maps and save them for a forward-only host.

Example::

    loca calibrate --model smollm2-135m-instruct --task sst2 --out runs/maps
    loca fit --model smollm2-135m-instruct --task sst2 --maps runs/maps --out runs/fit

The maps carry the checkpoint's fingerprint; ``loca fit --maps`` refuses them for another model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..calibrate import MAPS_CONFIG
from ..io import ensure_replaceable
from ..runs import refuse_model_folder
from .common import add_config_args, add_data_args, add_model_args, config_from_args, refuse_flags, setup_run


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_data_args(p, n_train=512, n_heldout=64, n_test=0)
    add_config_args(p)
    p.add_argument("--out", required=True, help="folder for feedback_maps.safetensors + feedback_config.json")


# LoCA flags that only Stage II uses: with one calibration round there is no fit to configure
STAGE_II = {"etas", "lam_rel", "ridge_center", "step_scale", "step_control", "eta_grow", "eta_shrink",
            "a_init", "recalibrate_every", "alignment_every", "max_iters", "patience", "groups",
            "rank"}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if config_from_args(args).calibration_rounds == 1:  # the effective value: flag, --config or preset
        refuse_flags(args, STAGE_II, "configure Stage II and do not apply to `loca calibrate` (with "
                     "--calibration-rounds 2 or more they configure the calibration's short "
                     "fits)")  # fmt: skip
    refuse_model_folder(Path(args.out), args.model)
    ensure_replaceable(Path(args.out), MAPS_CONFIG, "loca-feedback-maps")  # before the work
    run = setup_run(args)
    train, heldout = run.encode(run.splits.train), run.encode(run.splits.heldout)
    maps = run.calibrator(train, heldout, progress=True).calibrate()
    maps.meta.update({"task": run.task.name, "splits": run.splits.record})
    maps.save_pretrained(args.out)
    a = maps.meta["alignment"]
    for i, (p, h, r) in enumerate(zip(a["probe"], a["heldout"], a["random"], strict=True)):
        print(f"block {i:3d}: alignment probe {p:+.3f}  held-out {h:+.3f}  random {r:+.3f}")
    print(f"saved {maps.meta['probe_positions']} probe positions' maps to {args.out}")
    return 0
