"""The paper's Table 2 on GPU, preset by preset, and Stage II against sequence length: ``loca bench``
runs on the published Qwen2.5 shapes (random bf16 weights, no download), then one table and one
PNG.

    python scripts/gpu_presets.py --data-dir ../shared/data --out docs/results/bench/gpu-h100-presets

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

from loca.cli import main as loca
from loca.plotting import panel_grid, plt

PRESETS = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62,
           "qwen2.5-14b": 14.8}  # billions of parameters
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", default="128")
    ap.add_argument("--summary-only", action="store_true", help="only summarise the runs already in --out")
    args = ap.parse_args()
    out = Path(args.out)
    points = {}
    for preset in PRESETS:
        for task, phases, repeats in (("boolq", FULL, "2"), ("sst2", LIGHT, "3")):
            folder = out / f"{preset}-{task}"
            if args.summary_only and not (folder / "bench.json").is_file():
                continue
            argv = ["--model", f"arch:{preset}", "--task", task, "--data-dir", args.data_dir, "--n-train",
                    args.n_train, "--phases", phases, "--repeats", repeats, *COMMON]  # fmt: skip
            points[(preset, task)] = bench(folder, argv)
    lengths = {}
    for length in LENGTHS:
        folder = out / f"len-{length}"
        if args.summary_only and not (folder / "bench.json").is_file():
            continue
        argv = ["--model", "arch:qwen2.5-1.5b", "--task", "sst2", "--synthetic-length", str(length),
                "--n-train", "64", "--phases", LIGHT, "--repeats", "3", *COMMON]  # fmt: skip
        lengths[length] = bench(folder, argv)
    columns = ["preset", "full-run peak / LoRA peak (BoolQ)", "calibrate time (forward passes)",
               "stage2 / forward, SST-2 (eager)", "stage2 / forward, BoolQ (eager)",
               "stage2 / LoRA epoch (BoolQ)", "stage2-eager peak / backbone peak (BoolQ)"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    summary = {}
    for preset in PRESETS:
        b, s = (points.get((preset, t), {}).get("rows", {}) for t in ("boolq", "sst2"))
        row = {
            "full_run_peak_over_lora": ratio(b, "full-run", "lora", "peak_mb"),
            "calibrate_forward_passes": ratio(b, "calibrate", "forward", "time_s"),
            "stage2_over_forward_sst2": ratio(s, "stage2", "forward", "time_s"),
            "stage2_eager_over_forward_sst2": ratio(s, "stage2-eager", "forward", "time_s"),
            "stage2_over_forward_boolq": ratio(b, "stage2", "forward", "time_s"),
            "stage2_eager_over_forward_boolq": ratio(b, "stage2-eager", "forward", "time_s"),
            "stage2_over_lora": ratio(b, "stage2", "lora", "time_s"),
            "stage2_eager_peak_over_backbone": ratio(b, "stage2-eager", "backbone", "peak_mb"),
        }
        summary[preset] = row
        cells = [preset, fmt(row["full_run_peak_over_lora"]), fmt(row["calibrate_forward_passes"]),
                 f"{fmt(row['stage2_over_forward_sst2'])} ({fmt(row['stage2_eager_over_forward_sst2'])})",
                 f"{fmt(row['stage2_over_forward_boolq'])} ({fmt(row['stage2_eager_over_forward_boolq'])})",
                 fmt(row["stage2_over_lora"]), fmt(row["stage2_eager_peak_over_backbone"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    (out / "presets.md").write_text("\n".join(lines) + "\n")
    (out / "presets.json").write_text(json.dumps(summary, indent=2) + "\n")
    fig, axes = panel_grid(3)
    size = [PRESETS[p] for p in PRESETS if (p, "boolq") in points]
    rows = [points[(p, "boolq")]["rows"] for p in PRESETS if (p, "boolq") in points]
    for phase, style in (("forward", "o--"), ("stage2", "s-"), ("stage2-eager", "s:"), ("full-run", "d-"),
                         ("lora", "^-")):  # fmt: skip
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
