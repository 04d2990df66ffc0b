"""PNG plots of a comparison: held-out CE against wall time and against steps, test accuracy."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ..infra.plotting import panel_grid, plt
from .methods import METHODS, REGISTRY

# LoCA variants take C5–C9 (write_plots)
COLORS = {m.name: m.color for m in REGISTRY.values()}
FILES = ("heldout_vs_time.png", "heldout_vs_steps.png", "accuracy.png")


def _best_so_far(history: list[dict]) -> tuple[list[float], list[float]]:
    """Elapsed time and the best held-out CE reached by then, over all candidates."""
    xs, ys, best = [], [], math.inf
    for row in sorted(history, key=lambda r: r["elapsed_s"]):
        ce = row["heldout_ce"]
        if ce is not None and math.isfinite(ce) and ce < best:
            best = ce
        xs.append(max(row["elapsed_s"], 1e-3))
        ys.append(best)
    return xs, ys


def _selected_curve(fit: dict, adaptive: bool = False) -> tuple[list[int], list[float]]:
    """The selected trajectory's held-out CE against its step (the frozen model at step 0). A
    trajectory is a candidate (η, λ), or, with LoCA's ``adaptive`` step control, whose η moves
    every step, a λ: all its steps, not only those taken at the selected η."""
    history = fit["history"]
    chosen = fit["selected"] or None
    if chosen is None:  # frozen won: show the candidate that reached the lowest CE
        cands = [r for r in history if r["candidate"] is not None and r["heldout_ce"] is not None]
        chosen = min(cands, key=lambda r: r["heldout_ce"])["candidate"] if cands else None
    if adaptive and chosen is not None:
        same = lambda c: c.get("lam_rel") == chosen.get("lam_rel")  # noqa: E731
    else:
        same = lambda c: c == chosen  # noqa: E731
    rows = [r for r in history if r["candidate"] is None or same(r["candidate"])]
    rows = sorted(rows, key=lambda r: r["step"])
    return [max(r["step"], 0) for r in rows], [r["heldout_ce"] for r in rows]


def _adaptive(cell: dict) -> bool:
    """Whether a cell is a LoCA fit with the adaptive step control (its key records its config)."""
    return (cell.get("key", {}).get("config") or {}).get("step_control") == "adaptive"


def write_plots(out: str | Path, cells: list[dict], rows: list[dict]) -> list[Path]:
    out = Path(out)
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    variant_names = sorted({c["method"] for c in cells if c["method"] not in METHODS})
    colors = {**COLORS, **{v: f"C{5 + i % 5}" for i, v in enumerate(variant_names)}}
    methods = [m for m in METHODS if any(c["method"] == m for c in cells)] + variant_names
    by_task = defaultdict(list)
    for c in cells:
        by_task[c["task"]].append(c)
    written = []

    for fname, xlabel in (("heldout_vs_time.png", "wall time (s)"), ("heldout_vs_steps.png", "step")):
        fig, axes = panel_grid(len(tasks))
        for ax, task in zip(axes, tasks, strict=True):
            for c in sorted(by_task[task], key=lambda c: c["seed"]):
                m, fit = c["method"], c["fit"]
                label = f"{m} ({fit['step_unit']})" if fname.endswith("steps.png") else m
                label = label if c["seed"] == min(x["seed"] for x in by_task[task]) else None
                if m == "frozen":
                    ax.axhline(fit["heldout_ce"], color=colors[m], ls=":", lw=1, label=label and "frozen")
                    continue
                if "time" in fname:
                    xs, ys = _best_so_far(fit["history"])
                else:
                    xs, ys = _selected_curve(fit, _adaptive(c))
                ax.plot(
                    xs,
                    ys,
                    color=colors[m],
                    lw=1.2,
                    alpha=0.8,
                    label=label,
                    marker="." if len(xs) < 60 else None,
                )
            if "steps" in fname:
                ax.set_xscale("symlog", linthresh=1)
            else:
                ax.set_xscale("log")
            ax.set_title(task)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out CE" + (" (best so far)" if "time" in fname else ""))
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(out / fname)

    fig, ax = plt.subplots(figsize=(1.6 * len(tasks) * len(methods) / 3 + 3, 3.8))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        means, errs = [], []
        for t in tasks:
            vals = [r["acc"] for r in rows if r["task"] == t and r["method"] == m and r["acc"] is not None]
            mean = sum(vals) / len(vals) if vals else float("nan")
            means.append(mean)
            # min–max over seeds; clamped at 0 against the mean's rounding
            errs.append([[max(0.0, mean - min(vals))], [max(0.0, max(vals) - mean)]] if vals else [[0], [0]])
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(tasks))]
        yerr = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
        ax.bar(xs, means, width, yerr=yerr, capsize=2, color=colors[m], label=m)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("test accuracy (mean, min–max over seeds)")
    ax.legend(fontsize=7, ncol=len(methods))
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)
    written.append(out / "accuracy.png")
    return written
