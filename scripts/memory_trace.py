"""Where a ``loca bench`` phase's peak GPU memory goes: the allocations live at the peak, summed by
the source lines (in loca and the model) that made them.

    python scripts/memory_trace.py --model arch:qwen2.5-14b --task boolq --data-dir data \
        --out docs/results/bench/memory-trace-qwen2.5-14b-boolq.json

Each phase runs once untimed, then once under PyTorch's allocator history
(``torch.cuda.memory._record_memory_history``); the timeline of allocations and frees made during
that run gives the moment of the peak and what was live then. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from loca.bench.phases import build_phases
from loca.config import DataConfig, LocaConfig, ModelConfig
from loca.pipeline import Pipeline

MB = 2.0**20


def where(frames: list[dict], depth: int = 3) -> str:
    """The innermost ``depth`` frames in loca or the model's code, as ``file:line:function``."""
    ours = [
        f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
        for f in frames
        if "/loca/" in f["filename"] or "/transformers/models/" in f["filename"]
    ]
    return " < ".join(ours[:depth]) or "?"


def trace(fn) -> dict:
    """Peak memory beyond entry over one run of ``fn`` and, at the traced peak, the live
    allocations made during the run, summed by :func:`where`."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, now, best, at_best = {}, 0, 0, {}
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > best:
                best, at_best = now, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
    by_site = Counter()
    for event in at_best.values():
        by_site[where(event["frames"])] += event["size"]
    return {
        "peak_mb": (torch.cuda.max_memory_allocated() - base) / MB,
        "sites_mb": {site: size / MB for site, size in by_site.most_common()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="boolq")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--n-train", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--phases", default="backbone,stage2-eager,stage2")
    ap.add_argument("--top", type=int, default=10, help="sites printed per phase")
    ap.add_argument("--out", help="write the traces here (JSON)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_trace.py needs a CUDA device")
    pipeline = Pipeline(
        ModelConfig(model=args.model, dtype=args.dtype, device="cuda"),
        DataConfig(task=args.task, data_dir=args.data_dir, n_train=args.n_train, n_heldout=8, n_test=8),
        LocaConfig(),
        progress=False,
    )
    phases = build_phases(pipeline, [p.strip() for p in args.phases.split(",") if p.strip()])
    for fn in phases.values():  # warm-up: caches, graphs, allocator state
        fn()
    traces = {name: trace(fn) for name, fn in phases.items()}
    for name, t in traces.items():
        print(f"== {args.model} {args.task} {name}: peak beyond entry {t['peak_mb']:.1f} MB")
        for site, mb in list(t["sites_mb"].items())[: args.top]:
            print(f"  {mb:8.2f} MB  {site}")
    if args.out:
        setup = {
            "model": args.model,
            "task": args.task,
            "n_train": args.n_train,
            "dtype": args.dtype,
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
        }
        Path(args.out).write_text(json.dumps({"setup": setup, "phases": traces}, indent=2) + "\n")


if __name__ == "__main__":
    main()
