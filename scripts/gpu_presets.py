"""The paper's Table 2 on GPU, preset by preset, and Stage II against sequence length: ``loca bench``
runs on the published Qwen2.5 shapes (random bf16 weights, no download), then one table and one
PNG.

    python scripts/gpu_presets.py --data-dir data --out docs/results/bench/gpu-h100-presets

Per preset ``P``: ``P-boolq`` (forward, backbone, calibrate, stage2, stage2-eager, full-run, lora)
and ``P-sst2`` (forward, backbone, stage2, stage2-eager), 128 training sequences in batches of 8,
max length 256; per length ``L``: ``len-L`` (Qwen2.5-1.5B, 64 synthetic sequences of exactly L
tokens). A point whose ``bench.json`` is already in OUT is reused (an interrupted run resumes;
``--summary-only`` just redraws).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loca.cli.main import main as loca
from loca.infra.plotting import panel_grid, plt

PRESETS = {
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.8,
}  # billions of parameters
LENGTHS = (32, 64, 128, 256, 512, 1024)
FULL = "forward,backbone,calibrate,stage2,stage2-eager,full-run,lora"
LIGHT = "forward,backbone,stage2,stage2-eager"
COMMON = ["--dtype", "bfloat16", "--batch-size", "8", "--max-length", "256", "--quiet"]


def bench(folder: Path, argv: list[str]) -> dict:
    if not (folder / "bench.json").is_file() and loca(["bench", *argv, "--out", str(folder)]) != 0:
        raise SystemExit(f"loca bench failed for {folder.name}")
    report = json.loads((folder / "bench.json").read_text())
    return {"rows": {r["phase"]: r for r in report["rows"]}, "setup": report["setup"]}


def ratio(rows: dict, a: str, b: str, key: str) -> float | None:
    return rows[a][key] / rows[b][key] if a in rows and b in rows and rows[b][key] > 0 else None


COLUMNS = {  # summary key -> (column, numerator, denominator, task, measure)
    "full_run_peak_over_lora": ("full-run peak / LoRA peak (BoolQ)", "full-run", "lora", "boolq", "peak_mb"),
    "calibrate_forward_passes": ("calibrate time (forward passes)", "calibrate", "forward", "boolq", "time"),
    "stage2_over_forward_sst2": ("stage2 / forward, SST-2", "stage2", "forward", "sst2", "time"),
    "stage2_eager_over_forward_sst2": ("(eager)", "stage2-eager", "forward", "sst2", "time"),
    "stage2_over_forward_boolq": ("stage2 / forward, BoolQ", "stage2", "forward", "boolq", "time"),
    "stage2_eager_over_forward_boolq": ("(eager)", "stage2-eager", "forward", "boolq", "time"),
    "stage2_over_lora": ("stage2 / LoRA epoch (BoolQ)", "stage2", "lora", "boolq", "time"),
    "stage2_eager_peak_over_backbone": (
        "stage2-eager peak / backbone peak (BoolQ)",
        "stage2-eager",
        "backbone",
        "boolq",
        "peak_mb",
    ),
}
PAIRED = {
    "stage2_over_forward_sst2": "stage2_eager_over_forward_sst2",  # shown as "graphs (eager)"
    "stage2_over_forward_boolq": "stage2_eager_over_forward_boolq",
}


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def summarise(points: dict, time_key: str = "time_s") -> dict:
    """Per preset, the ratios of COLUMNS (times from ``time_key``: the median or ``time_s_min``)."""
    out = {}
    for preset in PRESETS:
        row = {}
        for key, (_, a, b, task, measure) in COLUMNS.items():
            rows = points.get((preset, task), {}).get("rows", {})
            row[key] = ratio(rows, a, b, time_key if measure == "time" else measure)
        out[preset] = row
    return out


def table(summary: dict, cell) -> list[str]:
    """A Markdown table of ``summary`` (``cell(row, key)`` formats one number), the eager time
    ratios in brackets after the graphs' ones."""
    keys = [k for k in COLUMNS if COLUMNS[k][0] != "(eager)"]
    heads = [COLUMNS[k][0] + (" (eager)" if k in PAIRED else "") for k in keys]
    lines = ["| preset | " + " | ".join(heads) + " |", "|" + "---|" * (len(keys) + 1)]
    for preset, row in summary.items():
        cells = [f"{cell(row, k)} ({cell(row, PAIRED[k])})" if k in PAIRED else cell(row, k) for k in keys]
        lines.append(f"| {preset} | " + " | ".join(cells) + " |")
    return lines


def stored(folder: Path) -> dict:
    """The phase rows of a run already in ``folder`` ({} if there is none)."""
    return bench(folder, [])["rows"] if (folder / "bench.json").is_file() else {}


def load(out: Path) -> dict:
    """The preset points already in ``out``."""
    return {(p, t): {"rows": stored(out / f"{p}-{t}")} for p in PRESETS for t in ("boolq", "sst2")}


def reproduce(out: Path, earlier: Path, points: dict) -> None:
    """``reproduce.md``: every ratio as ``earlier → this run``, by median and by fastest repeat."""
    before = load(earlier)
    text = [f"Ratios of `{earlier}` → `{out}` (same command, two runs).", ""]
    for key, what in (("time_s", "median"), ("time_s_min", "fastest repeat")):
        a, b = summarise(before, key), summarise(points, key)
        text += [f"Times by the {what} of the repeats:", ""]
        text += table({p: (a[p], b[p]) for p in PRESETS}, lambda r, k: f"{fmt(r[0][k])} → {fmt(r[1][k])}")
        text.append("")
        text += ["| sequence length | stage2 / forward | (eager) |", "|---|---|---|"]
        for length in LENGTHS:
            rows = [stored(d / f"len-{length}") for d in (earlier, out)]
            phases = ("stage2", "stage2-eager")
            cells = [" → ".join(fmt(ratio(r, phase, "forward", key)) for r in rows) for phase in phases]
            text.append(f"| {length} | " + " | ".join(cells) + " |")
        text.append("")
    (out / "reproduce.md").write_text("\n".join(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", default="128")
    ap.add_argument("--summary-only", action="store_true", help="only summarise the runs already in --out")
    ap.add_argument("--against", help="an earlier OUT: write OUT/reproduce.md, its ratios beside this run's")
    args = ap.parse_args()
    out = Path(args.out)
    points = {}
    for preset in PRESETS:
        for task, phases, repeats in (("boolq", FULL, "2"), ("sst2", LIGHT, "3")):
            folder = out / f"{preset}-{task}"
            if args.summary_only and not (folder / "bench.json").is_file():
                continue
            argv = [
                "--model",
                f"arch:{preset}",
                "--task",
                task,
                "--data-dir",
                args.data_dir,
                "--n-train",
                args.n_train,
                "--phases",
                phases,
                "--repeats",
                repeats,
                *COMMON,
            ]
            points[(preset, task)] = bench(folder, argv)
    lengths = {}
    for length in LENGTHS:
        folder = out / f"len-{length}"
        if args.summary_only and not (folder / "bench.json").is_file():
            continue
        argv = [
            "--model",
            "arch:qwen2.5-1.5b",
            "--task",
            "sst2",
            "--synthetic-length",
            str(length),
            "--n-train",
            "64",
            "--phases",
            LIGHT,
            "--repeats",
            "3",
            *COMMON,
        ]
        lengths[length] = bench(folder, argv)
    summary = summarise(points)
    lines = table(summary, lambda row, key: fmt(row[key]))
    (out / "presets.md").write_text("\n".join(lines) + "\n")
    if args.against:
        reproduce(out, Path(args.against), points)
    (out / "presets.json").write_text(json.dumps(summary, indent=2) + "\n")
    fig, axes = panel_grid(3)
    size = [PRESETS[p] for p in PRESETS if (p, "boolq") in points]
    rows = [points[(p, "boolq")]["rows"] for p in PRESETS if (p, "boolq") in points]
    for phase, style in (
        ("forward", "o--"),
        ("backbone", "x--"),
        ("stage2", "s-"),
        ("stage2-eager", "s:"),
        ("full-run", "d-"),
        ("lora", "^-"),
    ):
        axes[0].plot(size, [r[phase]["time_s"] / r["forward"]["time_s"] for r in rows], style, label=phase)
        axes[1].plot(size, [r[phase]["peak_mb"] / 1024 for r in rows], style, label=phase)
    panels = ((axes[0], "time / plain forward"), (axes[1], "peak memory beyond the model (GB)"))
    for ax, what in panels:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel(what)
        ax.set_title(f"{what.split(' (')[0]} vs model size (BoolQ)", fontsize=9)
        ax.legend(fontsize=7)
    xs = sorted(lengths)
    for phase, style in (("stage2", "s-"), ("stage2-eager", "s:")):
        ys = [ratio(lengths[x]["rows"], phase, "forward", "time_s") for x in xs]
        axes[2].plot(xs, ys, style, label=phase)
    axes[2].axhline(1.0, color="k", lw=0.5)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("sequence length (tokens, batches of 8)")
    axes[2].set_ylabel("time / plain forward")
    axes[2].set_title("Stage II vs the forward, Qwen2.5-1.5B", fontsize=9)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "presets.png", dpi=110)
    plt.close(fig)
    print((out / "presets.md").read_text())


if __name__ == "__main__":
    main()
