"""Stage I only: calibrate the feedback maps and save them for a forward-only host.

Example (two machines: the second needs no backward pass)::

    loca calibrate --task sst2 --data-dir data --out runs/maps            # with autograd
    loca fit --task sst2 --data-dir data --maps runs/maps --out runs/fit  # forward-only

The maps carry the checkpoint's fingerprint, the task and the splits they were calibrated on:
``loca fit --maps`` refuses them for another model or task, or when their probe examples would be
among the fit's held-out or test examples. With the same data flags and seed on both sides, the
fit equals ``loca fit`` calibrating in one process.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..infra.io import ensure_replaceable
from ..infra.runs import refuse_model_folder
from ..method.artefacts import MAPS_CONFIG
from .args import (
    add_config_args,
    add_data_args,
    add_model_args,
    add_output_args,
    config_from_args,
    pipeline_from_args,
    refuse_flags,
    section_fields,
)
from .fit_command import DATA_DEFAULTS

log = logging.getLogger("loca")
# the fit's splits (the probe comes from its training examples); the test split is not used here
CALIBRATE_DATA = {**DATA_DEFAULTS, "n_test": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_data_args(p, **CALIBRATE_DATA)
    add_config_args(
        p,
        notes={"fit": "used only with --calibration-rounds 2 or more, by the calibration rounds' short fits"},
    )
    p.add_argument("--out", required=True, help="folder for feedback_maps.safetensors + feedback_config.json")
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    if config_from_args(args).calibration_rounds == 1:  # the effective value: flag, --config or preset
        refuse_flags(
            args,
            section_fields("fit"),
            "configure Stage II and do not apply to `loca "
            "calibrate` (with --calibration-rounds 2 or more they configure the calibration's "
            "short fits)",
        )
    pipeline = pipeline_from_args(args, **CALIBRATE_DATA)
    refuse_model_folder(Path(args.out), pipeline.model_config.model)
    ensure_replaceable(Path(args.out), MAPS_CONFIG, "loca-feedback-maps")  # before the work
    maps = pipeline.calibrate()
    maps.save_pretrained(args.out)
    a = maps.meta["alignment"]
    for i, (p, h, r) in enumerate(zip(a["probe"], a["heldout"], a["random"], strict=True)):
        log.info(f"block {i:3d}: alignment probe {p:+.3f}  held-out {h:+.3f}  random {r:+.3f}")
    print(f"saved {maps.meta['probe_positions']} probe positions' maps to {args.out}")
    return 0
