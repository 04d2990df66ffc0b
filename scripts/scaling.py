"""Time and memory of a Stage II pass against the number of training tokens and the sequence
length, next to the plain forward: ``loca bench`` runs, one per point, then one PNG.

    python scripts/scaling.py --data-dir data --out docs/results/bench/scaling-cpu-smollm2

Each point is a ``loca bench --phases forward,stage2`` run (its ``bench.json`` is kept under
``OUT/runs``; points already there are reused, so an interrupted sweep resumes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loca.cli.main import main as loca
from loca.infra.plotting import panel_grid, plt

TOKENS = [("sst2", n, 256) for n in (32, 64, 128, 256)]  # (task, sequences, max length)
LENGTHS = [("boolq", 32, length) for length in (64, 128, 256, 512)]


def point(out: Path, model: str, data_dir: str, task: str, n: int, length: int, extra: list[str]) -> dict:
    folder = out / "runs" / f"{task}-n{n}-len{length}"
    if not (folder / "bench.json").is_file():
        argv = [
            "bench",
            "--model",
            model,
            "--task",
            task,
            "--data-dir",
            data_dir,
            "--n-train",
            str(n),
            "--max-length",
            str(length),
            "--phases",
            "forward,stage2",
            "--repeats",
            "2",
            "--quiet",
            "--out",
            str(folder),
            *extra,
        ]
        if loca(argv) != 0:
            raise SystemExit(f"loca bench failed for {folder.name}")
    report = json.loads((folder / "bench.json").read_text())
    rows = {r["phase"]: r for r in report["rows"]}
    return {
        "task": task,
        "sequences": n,
        "max_length": length,
        "tokens": report["setup"]["tokens"],
        "statistics_bytes": report["statistics_bytes"]["stage2_statistics"],
        **{f"{p}_{k}": rows[p][k] for p in rows for k in ("time_s", "peak_mb")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("extra", nargs="*", help="further `loca bench` flags (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    sweeps = {
        "training tokens": [point(out, args.model, args.data_dir, *p, args.extra) for p in TOKENS],
        "max length (BoolQ)": [point(out, args.model, args.data_dir, *p, args.extra) for p in LENGTHS],
    }
    (out / "scaling.json").write_text(json.dumps(sweeps, indent=2) + "\n")
    fig, axes = panel_grid(4)
    for col, (name, points) in enumerate(sweeps.items()):
        x = [p["tokens"] if name == "training tokens" else p["max_length"] for p in points]
        for phase, style in (("forward", "o--"), ("stage2", "s-")):
            axes[col].plot(x, [p[f"{phase}_time_s"] for p in points], style, label=phase)
            axes[col + 2].plot(x, [p[f"{phase}_peak_mb"] for p in points], style, label=phase)
        stats_mb = [p["statistics_bytes"] / 2**20 for p in points]
        axes[col + 2].plot(x, stats_mb, "k:", label="Stage II statistics")
        for ax, what in ((axes[col], "time (s)"), (axes[col + 2], "peak memory beyond the model (MB)")):
            ax.set_xlabel("training tokens" if name == "training tokens" else "max length (tokens)")
            ax.set_ylabel(what)
            ax.set_title(f"{what.split(' (')[0]} vs {name}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")


if __name__ == "__main__":
    main()
