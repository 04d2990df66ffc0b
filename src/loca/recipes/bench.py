"""Benchmark LoCA phases side by side on the same real batches: time and memory.

Example::

    loca bench --model smollm2-135m-instruct --task sst2 --phases forward,calibrate,stage2 --out runs/bench

Phases: ``forward`` (a plain inference forward pass of the causal LM, logits included, as a user
would run it), ``backbone`` (the same without the LM head: the strict lower bound of any pass),
``calibrate`` (Stage I: probe forward+backward and the ridge fits), ``stage2`` (one Stage II pass:
inference-mode forward with the statistics, head error at predict positions, and the block
solves, with non-zero adapters attached: :func:`loca.fit.stage2_pass`, the very step ``loca fit``
takes). Writes ``DIR/bench.json``. Under ``torchrun`` the calibrate and stage2 phases run
data-parallel (each rank its share of the batches; forward and backbone stay whole per rank).
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from .. import distributed
from ..adapters import ResidualAdapters
from ..bench import measure_phases
from ..calibrate import Calibrator
from ..fit import block_groups, stage2_pass
from ..io import atomic_write_json
from ..runs import prepare_run_dir
from ..versions import versions
from .common import add_config_args, add_data_args, add_model_args, add_output_args, pipeline_from_args

PHASES = ("forward", "backbone", "calibrate", "stage2")
DATA_DEFAULTS = dict(n_train=64, n_heldout=1, n_test=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_data_args(p, **DATA_DEFAULTS)
    add_config_args(p)
    p.add_argument(
        "--phases",
        default="forward,backbone,calibrate,stage2",
        help=f"comma-separated subset of {','.join(PHASES)}",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per phase (median reported)")
    p.add_argument("--out", required=True, help="folder for bench.json")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier `loca bench` run in --out")
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    if not phases:
        raise ValueError(f"--phases names no phase; choose from {PHASES}")
    run = pipeline_from_args(args, **DATA_DEFAULTS)
    model_cfg = run.model_config
    if distributed.is_main():  # under torchrun: rank 0 writes, every rank measures its share
        prepare_run_dir(args.out, "bench", model=model_cfg.model, overwrite=args.overwrite,
                        writes=("bench.json",))  # fmt: skip
    distributed.barrier()
    model, parts, task = run.model, run.parts, run.task
    cfg = run.cfg
    items = run.encoded()[0]
    batches = run.batches(items)
    dev = parts.device
    on_dev = [b.to(dev) for b in batches]

    def calib():  # Stage I on the training items (no held-out alignment diagnostic)
        return Calibrator(parts, items, [], cfg, run.pad_id).calibrate()

    maps = calib()  # stage2 needs maps whether or not calibrate is timed
    adapters = ResidualAdapters(parts, rank=cfg.rank, seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    b_start = [1e-3 * torch.randn(b.shape, generator=gen) for b in adapters.B]
    groups = block_groups(parts.num_blocks, cfg.groups)

    @torch.inference_mode()
    def forward():
        for b in on_dev:
            model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)

    @torch.inference_mode()
    def backbone():
        for b in on_dev:
            parts.backbone(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)

    def stage2():
        with adapters:
            stage2_pass(parts, adapters, maps, on_dev, b_start, cfg.etas[0], cfg.lam_rel[0], cfg, groups)

    fns = {"forward": forward, "backbone": backbone, "calibrate": calib, "stage2": stage2}
    results = measure_phases({p: fns[p] for p in phases}, dev, repeats=args.repeats)
    rows = [r.to_dict() for r in results]
    by = {r["phase"]: r for r in rows}
    ratios = {}
    for base in ("forward", "backbone"):
        if base in by:
            for r in rows:
                if r["phase"] != base:
                    ratios[f"{r['phase']}/{base}"] = {
                        "time": r["time_s"] / by[base]["time_s"],
                        "peak_mem": r["peak_mb"] / by[base]["peak_mb"] if by[base]["peak_mb"] > 0 else None,
                    }
    k, r_ = maps.rank, cfg.rank
    stat_bytes = {
        "stage2_statistics": parts.num_blocks * (r_ * r_ + k * r_) * 8,
        "feedback_maps": maps.nbytes(),
        "adapter_b": parts.num_blocks * parts.hidden_size * r_ * 4,
        "adapter_a": parts.num_blocks * parts.hidden_size * r_ * 4,
    }
    tokens = sum(int(b.attention_mask.sum()) for b in batches)
    report = {
        "rows": rows,
        "ratios": ratios,
        "statistics_bytes": stat_bytes,
        "setup": {
            "model": model_cfg.model,
            "task": task.name,
            "dtype": model_cfg.dtype,
            "device": str(dev),
            "sequences": len(items),
            "batches": len(batches),
            "tokens": tokens,
            "predict_positions": sum(b.n_positions for b in batches),
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "world_size": distributed.world_size(),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "loca": cfg.to_dict(),
            "versions": versions(),
        },
    }
    if not distributed.is_main():
        return 0
    atomic_write_json(Path(args.out) / "bench.json", report)
    print(f"{'phase':12}{'time_s':>10}{'min_s':>10}{'peak_mb':>10}{'median_mb':>11}")
    for r in rows:
        print(
            f"{r['phase']:12}{r['time_s']:>10.3f}{r['time_s_min']:>10.3f}{r['peak_mb']:>10.1f}{r['median_mb']:>11.1f}"
        )
    for name, v in ratios.items():
        mem = f"{v['peak_mem']:.2f}x" if v["peak_mem"] is not None else "n/a"
        print(f"{name:22} time {v['time']:.2f}x  peak memory {mem}")
    print(f"statistics: {stat_bytes}")
    return 0
