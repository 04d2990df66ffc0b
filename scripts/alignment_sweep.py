"""Sweep the feedback-map ridge, rank and probe size, and measure in-probe vs held-out alignment.

For each task, the probe gradients (head errors E and per-block hidden-state gradients G_l) are
computed once per probe size with :func:`loca.method.probe.probe_gradients`, and once for a fixed
held-out probe (``--heldout-positions`` predict positions of the held-out items, seed + 1, as
:class:`loca.method.calibrate.Calibrator` draws it). The probes are nested: the seeded
:func:`loca.method.probe.select_probe` takes items in one fixed order, so the smaller probe is a prefix
of the larger one and only the extra items of the larger probe need a backward pass. Then every
(beta_rel, k) is a cheap refit with :func:`loca.core.ridge.feedback_factors`, scored with
:func:`loca.core.ridge.alignment` on the probe and on the held-out probe.

Run from the project root::

    .venv/bin/python scripts/alignment_sweep.py --data-dir data \
        --out docs/results/alignment_sweep.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from loca.core.ridge import alignment, feedback_factors, random_factors
from loca.data import encode_examples, get_task, load_splits
from loca.data.batching import pad_token_id
from loca.infra.versions import versions
from loca.method.probe import probe_gradients, select_probe
from loca.models.parts import find_parts, fingerprint, load_model

SWEEP_KEYS = (
    "n_train",
    "n_heldout",
    "seed",
    "probe_positions",
    "heldout_positions",
    "heldout_large_positions",
    "betas",
    "ranks",
    "max_length",
    "micro_batch",
)  # settings a resumed run must share with the report it extends


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="loca alias, folder or hub id")
    p.add_argument("--data-dir", required=True, help="the task data folder (docs/tasks.md)")
    p.add_argument("--tasks", nargs="+", default=["arc_easy", "obqa", "hellaswag", "sst2"])
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-heldout", type=int, default=250)
    p.add_argument("--seed", type=int, default=0, help="split and probe seed (held-out probe: seed + 1)")
    p.add_argument(
        "--probe-positions",
        type=int,
        nargs="+",
        default=[1000, 3000, 10000],
        help="minimum predict positions per probe (capped by the train items)",
    )
    p.add_argument("--heldout-positions", type=int, default=250)
    p.add_argument(
        "--heldout-large-positions",
        type=int,
        default=1000,
        help="a second, less noisy held-out probe (a superset of the first; 0 = none)",
    )
    p.add_argument("--betas", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (more than the free cores slows the probe down many times)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the tasks already in --out (same settings) and run only the others",
    )
    p.add_argument("--out", default="docs/results/alignment_sweep.json")
    return p.parse_args(argv)


def summary(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "per_block": values,
    }


def targets(items) -> list[int]:
    """The token each predict position is trained to produce (completion tokens, EOS included)."""
    return [t for it in items for t in it.completion]


def token_stats(probe, heldout) -> dict:
    p, h = targets(probe), targets(heldout)
    seen = set(p)
    return {
        "probe_distinct_targets": len(seen),
        "heldout_distinct_targets": len(set(h)),
        "heldout_positions_with_unseen_target_in_probe": sum(t not in seen for t in h) / len(h) if h else 0.0,
    }


def nested_probes(parts, items, sizes, seed: int, micro_batch: int, pad: int):
    """Yield ``(size, probe, E, [G_l], seconds)`` for each probe size, smallest first.

    :func:`select_probe` takes items in one seeded order, so each probe extends the previous one;
    only the extra items get a backward pass (each sequence's gradients are independent of the
    others in its micro-batch).
    """
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    errs: list[torch.Tensor] = []
    grads: list[list[torch.Tensor]] = [[] for _ in range(parts.num_blocks)]
    done = 0
    for size in sorted(sizes):
        probe = select_probe(items, size, seed)
        if probe != [items[i] for i in order[: len(probe)]]:
            raise RuntimeError("select_probe no longer draws nested probes")
        t0 = time.perf_counter()
        if len(probe) > done:
            e, g = probe_gradients(parts, probe[done:], micro_batch, pad)
            errs.append(e)
            for i in range(parts.num_blocks):
                grads[i].append(g[i])
        done = len(probe)
        yield size, probe, torch.cat(errs), [torch.cat(g) for g in grads], time.perf_counter() - t0


def run_task(args, parts, tokenizer, task_name: str) -> dict:
    task = get_task(task_name)
    splits = load_splits(
        task,
        n_train=args.n_train,
        n_heldout=args.n_heldout,
        n_test=1,
        seed=args.seed,
        data_dir=args.data_dir,
    )
    enc = dict(max_length=args.max_length, add_eos=True)
    train = encode_examples(tokenizer, task, splits.train, **enc)
    heldout = encode_examples(tokenizer, task, splits.heldout, **enc)
    pad = pad_token_id(tokenizer)

    # held-out probes: the diagnostic's 250 positions (seed + 1) and a larger superset of it
    held: dict[str, tuple] = {}
    sizes = {"heldout": args.heldout_positions}
    if args.heldout_large_positions > args.heldout_positions:
        sizes["heldout_large"] = args.heldout_large_positions
    names = {v: k for k, v in sizes.items()}
    held_meta = {}
    for size, probe, e, g, sec in nested_probes(
        parts, heldout, list(sizes.values()), args.seed + 1, args.micro_batch, pad
    ):
        held[names[size]] = (probe, e, g)
        held_meta[names[size]] = {"items": len(probe), "positions": int(e.shape[0]), "grad_seconds": sec}
        print(
            f"[{task_name}] {names[size]} probe: {len(probe)} items, {e.shape[0]} positions, {sec:.0f}s",
            flush=True,
        )

    results = []
    gen = torch.Generator().manual_seed(args.seed)
    for size, probe, e_p, g_p, sec in nested_probes(
        parts, train, args.probe_positions, args.seed, args.micro_batch, pad
    ):
        print(
            f"[{task_name}] probe >= {size}: {len(probe)} items, {e_p.shape[0]} positions "
            f"(extra items in {sec:.0f}s)",
            flush=True,
        )
        stats = {name: token_stats(probe, h[0]) for name, h in held.items()}
        for k in args.ranks:
            rand = [random_factors(parts.hidden_size, k, gen) for _ in range(parts.num_blocks)]
            _, h_err, h_grads = held["heldout"]
            rand_h = [alignment(r, h_err, g) for r, g in zip(rand, h_grads, strict=True)]
            for beta in args.betas:
                t1 = time.perf_counter()
                factors = feedback_factors(e_p, g_p, beta, k)
                row = {
                    "probe_target": size,
                    "probe_items": len(probe),
                    "probe_positions": int(e_p.shape[0]),
                    "beta_rel": beta,
                    "rank": k,
                    "probe": summary([alignment(f, e_p, g) for f, g in zip(factors, g_p, strict=True)]),
                }
                for name, (_, e_h, g_h) in held.items():
                    row[name] = summary([alignment(f, e_h, g) for f, g in zip(factors, g_h, strict=True)])
                row["random_heldout"] = summary(rand_h)
                row["targets"] = stats
                row["fit_seconds"] = time.perf_counter() - t1
                row["probe_grad_seconds_incremental"] = sec
                results.append(row)
    return {
        "task": task_name,
        "train_items": len(train),
        "heldout_items": len(heldout),
        "heldout_probes": held_meta,
        "results": results,
    }


def print_table(report: dict) -> None:
    betas = report["config"]["betas"]
    head = f"{'task':<10} {'probe':>5} {'pos':>5} {'k':>3} | " + " ".join(f"{b:>16g}" for b in betas)
    print("\nmedian alignment over blocks per beta_rel: in-probe / held-out probe / larger held-out probe")
    print(head)
    print("-" * len(head))
    for t in report["tasks"]:
        rows: dict[tuple, dict] = {}
        for r in t["results"]:
            rows.setdefault((r["probe_target"], r["probe_positions"], r["rank"]), {})[r["beta_rel"]] = r
        for (size, pos, k), by_beta in rows.items():
            cells = []
            for b in betas:
                r = by_beta[b]
                all_h = f"{r['heldout_large']['median']:+.2f}" if "heldout_large" in r else "  -  "
                cells.append(f"{r['probe']['median']:.2f}/{r['heldout']['median']:+.2f}/{all_h}".rjust(16))
            print(f"{t['task']:<10} {size:>5} {pos:>5} {k:>3} | {' '.join(cells)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, device="cpu")
    parts = find_parts(model)
    report = {
        "what": "feedback-map alignment, in-probe vs held-out, over beta_rel x feedback rank x probe size",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {k: v for k, v in vars(args).items()},
        "model": args.model,
        "fingerprint": fingerprint(parts),
        "platform": platform.platform(),
        "versions": versions(),
        "tasks": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["commands"] = [report["command"]]
    seconds = 0.0
    if args.resume and out.is_file():
        old = json.loads(out.read_text())
        differ = [k for k in SWEEP_KEYS if old["config"].get(k) != report["config"][k]]
        if differ or old["model"] != args.model:
            raise SystemExit(f"--resume: {out} was run with other settings ({differ or 'model'})")
        report["tasks"] = [t for t in old["tasks"] if t["task"] in args.tasks]
        report["commands"] = old.get("commands", [old["command"]]) + [report["command"]]
        seconds = old.get("total_seconds", 0.0)
    report["total_seconds"] = seconds
    have = {t["task"] for t in report["tasks"]}
    t0 = time.perf_counter()
    for task_name in args.tasks:
        if task_name in have:
            print(f"[{task_name}] kept from {out}")
            continue
        report["tasks"].append(run_task(args, parts, tokenizer, task_name))
        report["total_seconds"] = seconds + time.perf_counter() - t0
        out.write_text(json.dumps(report, indent=1) + "\n")
    order = {name: i for i, name in enumerate(args.tasks)}
    report["tasks"].sort(key=lambda t: order[t["task"]])
    out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"\nwrote {out} ({report['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
