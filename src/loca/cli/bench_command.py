"""Benchmark LoCA phases and its baselines side by side on the same real batches: time, memory.

Example::

    loca bench --model smollm2-135m-instruct --task sst2 --data-dir data \
        --phases forward-floor,calibrate,stage2,full-run,lora,adapter-mezo --out runs/bench

Phases (see :mod:`loca.bench.phases`): ``forward-floor`` (the best inference forward: logits only
at the predict positions, graph-captured on one CUDA device; every ``× floor`` ratio is taken
against it), ``forward`` (the plain full-logits eager forward), ``backbone``, ``calibrate``, ``stage2`` (one
Stage II step, :func:`loca.method.stage2.stage2_pass`, the very step ``loca fit`` takes), ``stage2-eager``
(the same without CUDA graphs), ``full-run`` (calibration + a short fit), ``lora`` (one epoch of
PEFT LoRA), ``adapter-mezo`` and ``mezo`` (as many SPSA steps). ``--synthetic-length L`` runs on
random token sequences of exactly L tokens instead of the task's. Interleaved and repeated;
writes ``DIR/bench.json`` and ``DIR/bench.md`` (ratios to the floor and to LoRA, shaped like the
paper's Table 2). Under ``torchrun`` the LoCA phases run data-parallel.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from ..bench.measure import measure_phases
from ..bench.phases import PHASES, build_phases, ratio_table
from ..data.synthetic import synthetic_items
from ..infra import distributed
from ..infra.io import atomic_write_json, atomic_write_text
from ..infra.runs import prepare_run_dir
from ..infra.versions import versions
from .args import add_config_args, add_data_args, add_model_args, add_output_args, pipeline_from_args

DATA_DEFAULTS = dict(n_train=64, n_heldout=1, n_test=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_data_args(p, **DATA_DEFAULTS)
    add_config_args(p)
    p.add_argument(
        "--phases",
        default="forward-floor,forward,backbone,calibrate,stage2",
        help=f"comma-separated subset of {','.join(PHASES)}",
    )
    p.add_argument(
        "--synthetic-length",
        type=int,
        default=0,
        help="run on --n-train (and --n-heldout) synthetic sequences of exactly this many random tokens, "
        "answer + EOS at the end, instead of the task's data (0 = the task's real lengths)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per phase (median reported)")
    p.add_argument("--full-run-iters", type=int, default=5, help="fit iterations of the full-run phase")
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
    if args.synthetic_length:
        eos = run.tokenizer.eos_token_id if run.cfg.add_eos else None
        vocab = min(len(run.tokenizer), run.parts.vocab_size)
        make = lambda n, seed: synthetic_items(n, args.synthetic_length, vocab, seed, eos)  # noqa: E731
        run.use_items(make(run.data.n_train, run.cfg.seed), make(run.data.n_heldout, run.cfg.seed + 1))
    if distributed.is_main():  # under torchrun: rank 0 writes, every rank measures its share
        prepare_run_dir(
            args.out,
            "bench",
            model=model_cfg.model,
            overwrite=args.overwrite,
            writes=("bench.json", "bench.md"),
        )
    distributed.barrier()
    parts, task, cfg = run.parts, run.task, run.cfg
    items = run.encoded()[0]
    batches = run.batched()[0]
    dev = parts.device
    fns = build_phases(run, phases, full_run_iters=args.full_run_iters)
    results = measure_phases(fns, dev, repeats=args.repeats)
    rows = [r.to_dict() for r in results]
    by = {r["phase"]: r for r in rows}
    ratios = {}
    for base in ("forward-floor", "forward", "backbone"):
        if base in by:
            for r in rows:
                if r["phase"] != base:
                    ratios[f"{r['phase']}/{base}"] = {
                        "time": r["time_s"] / by[base]["time_s"],
                        "peak_mem": r["peak_mb"] / by[base]["peak_mb"] if by[base]["peak_mb"] > 0 else None,
                    }
    k, r_ = cfg.feedback_rank, cfg.rank
    stat_bytes = {
        "stage2_statistics": parts.num_blocks * (r_ * r_ + k * r_) * 8,
        "feedback_maps": parts.num_blocks * parts.hidden_size * k * 2 * 4,
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
            "task": f"synthetic ({args.synthetic_length} tokens)" if args.synthetic_length else task.name,
            "synthetic_length": args.synthetic_length or None,
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
    table = ratio_table(rows, tokens)
    atomic_write_text(Path(args.out) / "bench.md", f"{_caption(report['setup'])}\n\n{table}\n")
    print(f"{'phase':12}{'time_s':>10}{'min_s':>10}{'peak_mb':>10}{'median_mb':>11}")
    for r in rows:
        print(
            f"{r['phase']:12}{r['time_s']:>10.3f}{r['time_s_min']:>10.3f}{r['peak_mb']:>10.1f}{r['median_mb']:>11.1f}"
        )
    for name, v in ratios.items():
        mem = f"{v['peak_mem']:.2f}x" if v["peak_mem"] is not None else "n/a"
        print(f"{name:22} time {v['time']:.2f}x  peak memory {mem}")
    print(statistics_table(stat_bytes))
    print(table)
    return 0


STATISTICS_LABELS = {
    "stage2_statistics": "Stage II statistics (float64, r² + k·r per block)",
    "feedback_maps": "feedback maps (float32, 2·d·k per block)",
    "adapter_b": "adapters' B (float32, d·r per block)",
    "adapter_a": "adapters' A (float32, d·r per block)",
}


def statistics_table(stat_bytes: dict) -> str:
    """The sizes of what LoCA holds besides the model (``bench.json``'s ``statistics_bytes``), one
    line each, in bytes and a readable unit."""
    width = max(len(STATISTICS_LABELS.get(k, k)) for k in stat_bytes)
    lines = ["what LoCA holds besides the model:"]
    for key, n in stat_bytes.items():
        lines.append(f"  {STATISTICS_LABELS.get(key, key):{width}}  {_readable(n):>10}  ({n:,} bytes)")
    return "\n".join(lines)


def _readable(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _caption(setup: dict) -> str:
    where = setup["gpu"] or f"CPU ({setup['threads']} threads)"
    return (
        f"`loca bench`: {setup['model']} ({setup['dtype']}) on {where}, task {setup['task']}: "
        f"{setup['sequences']} sequences in {setup['batches']} batches, {setup['tokens']} tokens; "
        "median time of the repeats, peak and median memory beyond the loaded model"
    )
