"""A report over ``loca fit`` run folders: their held-out CE trajectories, a Markdown table of the
selections and metrics, and PNG plots of the trajectories and the maps' per-block alignment."""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..infra.io import atomic_write_json, atomic_write_text
from ..infra.plotting import panel_grid, plt

FILES = ("report.md", "report.json", "heldout_ce.png", "alignment.png")
COLUMNS = {  # row key -> table heading
    "run": "run",
    "task": "task",
    "model": "model",
    "step_control": "step",
    "eta": "best η",
    "lam_rel": "λ_rel",
    "best_iteration": "best it.",
    "heldout_ce": "held-out CE frozen → LoCA",
    "test_ce": "test CE frozen → LoCA",
    "test_acc": "test acc frozen → LoCA",
    "delta_test_ce": "Δ test CE",
    "delta_test_acc": "Δ acc",
    "alignment": "alignment probe / held-out / random",
    "fit_wall_time_s": "fit time (s)",
}


@dataclass(frozen=True)
class Run:
    """One ``loca fit`` run folder, read."""

    name: str
    path: Path
    config: dict
    history: list[dict]
    results: dict
    alignment: dict  # per-block "probe", "heldout", "random" (empty when none was recorded)

    @property
    def task(self) -> str | None:
        task = self.results.get("task")
        return task.get("name") if isinstance(task, dict) else task

    @property
    def step_control(self) -> str:
        found = (self.config.get("loca") or {}).get("step_control")
        return found or ("adaptive" if any("accepted" in r for r in self.history) else "fixed")


@dataclass(frozen=True)
class Trajectory:
    """One candidate's held-out CE over iterations: an (η, λ_rel) pair with fixed steps, a λ_rel
    (whose η changes every step) with adaptive ones."""

    eta: float | None  # None: adaptive
    lam_rel: float
    iterations: list[int]
    heldout_ce: list[float | None]  # None: a step that failed
    etas: list[float]
    accepted: list[bool] | None  # adaptive only

    def label(self, with_lam: bool) -> str:
        if self.eta is None:
            return f"λ_rel={self.lam_rel:g}"
        return f"η={self.eta:g}" + (f", λ_rel={self.lam_rel:g}" if with_lam else "")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} is missing: not a finished `loca fit` run folder")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _read_history(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"{path} is missing: not a finished `loca fit` run folder")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {i} is not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or "iteration" not in row:
            raise ValueError(f"{path} line {i} is not a history row (a JSON object with an iteration)")
        rows.append(row)
    return rows


def read_run(folder: str | Path, name: str | None = None) -> Run:
    """Read a ``loca fit`` run folder; ValueError naming the file when one is missing or malformed,
    or when the folder holds another command's run."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"run folder {folder} does not exist")
    config = _read_json(folder / "config.json")
    command = config.get("command")
    if command != "fit":
        found = f"a `loca {command}` run" if isinstance(command, str) else "no loca run (it names no command)"
        raise ValueError(f"{folder / 'config.json'} describes {found}; `loca report` reads `loca fit` runs")
    history = _read_history(folder / "history.jsonl")
    results = _read_json(folder / "results.json")
    missing = [k for k in ("frozen", "loca", "best_iteration") if k not in results]
    if missing or not all(isinstance(results[k], dict) for k in ("frozen", "loca")):
        raise ValueError(f"{folder / 'results.json'} is not a `loca fit` result (lacks {', '.join(missing)})")
    alignment = results.get("alignment") or {}
    maps_config = folder / "maps" / "feedback_config.json"
    if not alignment and maps_config.is_file():
        alignment = _read_json(maps_config).get("alignment") or {}
    return Run(name or folder.name, folder, config, history, results, alignment)


def read_runs(folders: list[str | Path]) -> list[Run]:
    """Read several run folders, named by folder name (by the path given, where names clash)."""
    names = [Path(f).name for f in folders]
    if len(set(names)) < len(names):
        names = [str(f) for f in folders]
    return [read_run(f, n) for f, n in zip(folders, names, strict=True)]


def trajectories(history: list[dict], step_control: str) -> list[Trajectory]:
    """The training rows grouped into trajectories, in order of first appearance: by (η, λ_rel)
    with fixed steps, by λ_rel with adaptive ones. The frozen row and diagnostics are left out."""
    groups: dict[tuple, list[dict]] = {}
    for row in history:
        if "diagnostic" in row or row.get("eta") is None:
            continue
        lam = row.get("lam_rel", row.get("lam"))
        key = (lam,) if step_control == "adaptive" else (row["eta"], lam)
        groups.setdefault(key, []).append(row)
    return [
        Trajectory(
            eta=None if step_control == "adaptive" else key[0],
            lam_rel=key[-1],
            iterations=[r["iteration"] for r in rows],
            heldout_ce=[r.get("heldout_ce") for r in rows],
            etas=[r["eta"] for r in rows],
            accepted=[bool(r.get("accepted")) for r in rows] if step_control == "adaptive" else None,
        )
        for key, rows in groups.items()
    ]


def running_best(traj: Trajectory, start: float) -> list[float]:
    """The best held-out CE reached by each of ``traj``'s iterations, from ``start`` (frozen)."""
    best, out = start, []
    for ce in traj.heldout_ce:
        if ce is not None and math.isfinite(ce):
            best = min(best, ce)
        out.append(best)
    return out


def alignment_medians(history: list[dict]) -> tuple[list[int], list[float]]:
    """Iterations and median per-block held-out alignment of the ``--alignment-every`` rows."""
    rows = [r for r in history if r.get("diagnostic") == "heldout_alignment"]
    return [r["iteration"] for r in rows], [r["median"] for r in rows]


def _num(x) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def _median(xs) -> float | None:
    xs = [v for v in (xs or []) if _num(v) is not None]
    return statistics.median(xs) if xs else None


def _delta(a, b) -> float | None:
    return None if _num(a) is None or _num(b) is None else b - a


def table_row(run: Run) -> dict:
    """One run's selection and metrics (frozen and LoCA), as plain data."""
    r, frozen, loca = run.results, run.results["frozen"], run.results["loca"]
    return {
        "run": run.name,
        "path": str(run.path),
        "task": run.task,
        "model": r.get("model") or run.config.get("model"),
        "step_control": run.step_control,
        "eta": _num(r.get("eta")),
        "lam_rel": _num(r.get("lam_rel", r.get("lam"))),
        "best_iteration": r["best_iteration"],
        "improved": r.get("improved"),
        **{
            f"{k}_{m}": _num(d.get(m))
            for k, d in (("frozen", frozen), ("loca", loca))
            for m in ("heldout_ce", "test_ce", "test_acc")
        },
        "delta_test_ce": _delta(frozen.get("test_ce"), loca.get("test_ce")),
        "delta_test_acc": _delta(frozen.get("test_acc"), loca.get("test_acc")),
        **{f"alignment_{k}": _median(run.alignment.get(k)) for k in ("probe", "heldout", "random")},
        "fit_wall_time_s": _num(r.get("fit_wall_time_s")),
    }


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _cell(row: dict, key: str) -> str:
    if key in ("heldout_ce", "test_ce", "test_acc"):
        return f"{_fmt(row[f'frozen_{key}'], '.4f')} → {_fmt(row[f'loca_{key}'], '.4f')}"
    if key == "alignment":
        return " / ".join(_fmt(row[f"alignment_{k}"], "+.2f") for k in ("probe", "heldout", "random"))
    spec = {
        "eta": ".3g",
        "lam_rel": ".3g",
        "delta_test_ce": "+.4f",
        "delta_test_acc": "+.4f",
        "fit_wall_time_s": ".1f",
    }.get(key, "")
    return _fmt(row[key], spec).replace("|", "\\|")


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table, one line per run."""
    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row, k) for k in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def _points(t: Trajectory) -> list[tuple[int, float, bool | None]]:
    """(iteration, held-out CE, accepted) of ``t``'s steps that have a finite CE."""
    accepted = t.accepted or [None] * len(t.iterations)
    rows = zip(t.iterations, t.heldout_ce, accepted, strict=True)
    return [(it, ce, a) for it, ce, a in rows if _num(ce) is not None]


def _heldout_panel(ax, run: Run) -> None:
    frozen = run.results["frozen"]["heldout_ce"]
    trajs = trajectories(run.history, run.step_control)
    with_lam = len({t.lam_rel for t in trajs}) > 1
    ax.axhline(frozen, color="0.4", ls="--", lw=1, label="frozen")
    for i, t in enumerate(trajs):
        color = f"C{i % 10}"
        points = _points(t)
        if t.accepted is None:
            ax.plot(
                [0, *(p[0] for p in points)],
                [frozen, *(p[1] for p in points)],
                color=color,
                lw=1.2,
                marker=".",
                label=t.label(with_lam),
            )
            continue
        for accepted in (True, False):
            sel = [(it, ce) for it, ce, a in points if a is accepted]
            if sel:
                ax.scatter(
                    *zip(*sel, strict=True),
                    s=18,
                    edgecolors=color,
                    linewidths=1,
                    facecolors=color if accepted else "none",
                )
        ax.plot(
            [0, *t.iterations],
            [frozen, *running_best(t, frozen)],
            color=color,
            lw=1.2,
            drawstyle="steps-post",
            label=f"{t.label(with_lam)}: best (hollow: rejected)",
        )
    best_it = run.results["best_iteration"]  # the frozen model's CE when nothing beat it (it. 0)
    ax.plot(
        [best_it],
        [run.results["loca"]["heldout_ce"]],
        "k*",
        ms=11,
        zorder=5,
        label=f"selected (it. {best_it})",
    )
    handles, labels = ax.get_legend_handles_labels()
    its, medians = alignment_medians(run.history)
    if its:
        twin = ax.twinx()
        twin.plot(its, medians, color="0.5", ls=":", marker="x", ms=4, label="median held-out alignment")
        twin.set_ylabel("median held-out alignment", fontsize=8)
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ces = [frozen, *(ce for t in trajs for ce in t.heldout_ce if _num(ce) is not None)]
    if min(ces) > 0 and max(ces) / min(ces) > 4:  # a fit that ends far below the frozen CE: show its tail
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{run.name} ({run.task}, {run.step_control})", fontsize=9)
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out CE")
    ax.legend(handles, labels, fontsize=7)


def _alignment_panel(ax, run: Run) -> None:
    styles = {"probe": ("C0", "-"), "heldout": ("C1", "-"), "random": ("0.5", "--")}
    for key, (color, ls) in styles.items():
        values = run.alignment.get(key) or []
        if values:
            ax.plot(
                range(len(values)),
                values,
                color=color,
                ls=ls,
                marker=".",
                lw=1.2,
                label={"heldout": "held-out", "random": "random map"}.get(key, key),
            )
    if not any(run.alignment.get(k) for k in styles):
        ax.text(0.5, 0.5, "no alignment recorded", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)
    ax.axhline(0, color="0.8", lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{run.name} ({run.task})", fontsize=9)
    ax.set_xlabel("block")
    ax.set_ylabel("alignment cos(F E, G)")


def _save_png(fig, path: Path) -> None:
    """Write ``fig`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)


def write_plots(out: Path, runs: list[Run]) -> list[Path]:
    """``heldout_ce.png`` and ``alignment.png``, one panel per run."""
    written = []
    for name, panel in (("heldout_ce.png", _heldout_panel), ("alignment.png", _alignment_panel)):
        fig, axes = panel_grid(len(runs))
        for ax, run in zip(axes, runs, strict=True):
            panel(ax, run)
        fig.tight_layout()
        _save_png(fig, out / name)
        written.append(out / name)
    return written


def write_report(out: str | Path, runs: list[Run]) -> str:
    """Write :data:`FILES` into ``out`` and return the Markdown table."""
    out = Path(out)
    rows = [table_row(run) for run in runs]
    table = markdown_table(rows)
    write_plots(out, runs)
    folders = "\n".join(f"- `{row['run']}`: `{row['path']}`" for row in rows)
    md = (
        f"# LoCA fit runs\n\n{table}\n\nAlignment: median over blocks of the fitted maps on the probe "
        "and the held-out probe, and of a random map.\n\nRun folders:\n\n"
        f"{folders}\n\n![held-out CE](heldout_ce.png)\n\n![alignment](alignment.png)\n"
    )
    atomic_write_text(out / "report.md", md)
    atomic_write_json(out / "report.json", {"command": "report", "rows": rows})
    return table
