"""The comparison's report from its stored cells: rows, ``results.json``/``.csv``, ``table.md``
(shaped like the paper's Table 1, mean ± spread over seeds) and PNG plots.

Recovery ratios of a cell, on test CE/accuracy against the same task and seed: ``R_CE`` and
``R_acc`` against LoRA (every method), ``R_ceiling = (CE_frozen − CE_m)/(CE_frozen − CE_ceiling)``
against Adapter-BP, LoCA's adapters trained by backprop (LoCA and its variants only): the share of
what its own adapters can reach that LoCA's credit assignment gets. The ceiling is the
``adapter-bp-predict`` cell when it ran, else ``adapter-bp`` (:data:`~.methods.CEILINGS`)."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from ..eval.metrics import RECOVERY_FLAG, RECOVERY_MIN_ITEMS, recovery_acc, recovery_ce
from ..infra.io import atomic_write_json, atomic_write_text
from .methods import CEILINGS, METHODS, REGISTRY, VARIANT, lookup
from .store import jsonable

LABELS = {m.name: m.label for m in REGISTRY.values()}
METRICS = ("test_ce", "test_ce_no_eos", "acc", "acc_norm")
COLUMNS = [
    "model",
    "device",
    "task",
    "seed",
    "method",
    "n_train",
    "n_heldout",
    "n_test",
    "heldout_ce",
    "frozen_heldout_ce",
    "test_ce",
    "test_ce_stderr",
    "test_ce_no_eos",
    "test_ce_no_eos_stderr",
    "acc",
    "acc_stderr",
    "acc_norm",
    "acc_norm_stderr",
    "R_CE",
    "R_acc",
    "R_ceiling",
    "ceiling_method",
    "selected",
    "best_step",
    "step_unit",
    "improved",
    "time_to_best_s",
    "time_to_loca_s",
    "fit_wall_time_s",
    "total_wall_time_s",
    "peak_memory_mb",
    "memory_kind",
]


def loca_like(method: str) -> bool:
    """LoCA, LoCA with absolute η, or a LoCA variant: the methods that get an R_ceiling."""
    record = lookup(method)
    return record is not None and record.r_ceiling


def time_to_reach(history: list[dict], target: float) -> float | None:
    """Seconds from a method's start (LoCA: calibration included) to the first held-out
    evaluation at or below ``target``; None if it never got there."""
    for h in history:
        if h.get("heldout_ce") is not None and h["heldout_ce"] <= target:
            return h["elapsed_s"]
    return None


def rows_from_cells(cells: list[dict]) -> list[dict]:
    """One row per method × task × seed, with R_CE / R_acc against that task and seed's LoRA and,
    for LoCA-like methods, R_ceiling against its Adapter-BP (``ceiling_method`` names which)."""
    by = {(c["task"], c["seed"], c["method"]): c for c in cells}
    rows = []
    for c in cells:
        key, fit, test = c["key"], c["fit"], c["test"]
        row = {
            "model": key["model"],
            "device": c["device"],
            "task": c["task"],
            "seed": c["seed"],
            "method": c["method"],
            **{k: key["sizes"][k] for k in ("n_train", "n_heldout", "n_test")},
            "heldout_ce": fit["heldout_ce"],
            "frozen_heldout_ce": fit["frozen_heldout_ce"],
            "selected": fit["selected"],
            "best_step": fit["best_step"],
            "step_unit": fit["step_unit"],
            "improved": fit["improved"],
            "time_to_best_s": fit["time_to_best_s"],
            "time_to_loca_s": None,
            "fit_wall_time_s": fit["wall_time_s"],
            "total_wall_time_s": c["wall_time_s"],
            "peak_memory_mb": c["peak_memory_mb"],
            "memory_kind": c["memory_kind"],
        }
        for m in METRICS:
            row[m] = test.get(m)
            row[f"{m}_stderr"] = test.get(f"{m}_stderr")
        frozen = by.get((c["task"], c["seed"], "frozen"))
        lora = by.get((c["task"], c["seed"], "lora"))
        row["R_CE"] = row["R_acc"] = None
        if frozen and lora and c["method"] not in ("frozen",):
            f, lo = frozen["test"], lora["test"]
            row["R_CE"] = recovery_ce(f["test_ce"], test["test_ce"], lo["test_ce"])
            row["R_acc"] = recovery_acc(f["acc"], test["acc"], lo["acc"], n_test=lo.get("n_test"))
        loca = by.get((c["task"], c["seed"], "loca"))
        if loca and c["method"] != "frozen":  # time to LoCA's selected held-out CE
            row["time_to_loca_s"] = time_to_reach(fit["history"], loca["fit"]["heldout_ce"])
        row["R_ceiling"] = row["ceiling_method"] = None
        ceiling = next((m for m in CEILINGS if (c["task"], c["seed"], m) in by), None)
        if frozen and ceiling and loca_like(c["method"]):
            ce_ceiling = by[(c["task"], c["seed"], ceiling)]["test"]["test_ce"]
            row["R_ceiling"] = recovery_ce(frozen["test"]["test_ce"], test["test_ce"], ce_ceiling)
            row["ceiling_method"] = ceiling
        rows.append(row)
    rows.sort(key=lambda r: (r["task"], r["seed"], _order(r["method"]), r["method"]))
    return rows


def _order(method: str) -> float:
    """METHODS order; a LoCA variant (loca@NAME) right after LoCA."""
    if method.startswith(VARIANT):
        return METHODS.index("loca") + 0.5
    return METHODS.index(method) if method in METHODS else len(METHODS)


def variants(rows: list[dict]) -> list[str]:
    """LoCA and its variants present in ``rows``, LoCA first."""
    names = sorted({r["method"] for r in rows if r["method"].startswith(VARIANT)})
    return (["loca"] if any(r["method"] == "loca" for r in rows) else []) + names


def _mean_spread(values: list[float]) -> tuple[float, float, int]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan, 0
    spread = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return statistics.fmean(vals), spread, len(vals)


def _fmt(values: list[float], digits: int = 3, n_expected: int | None = None) -> str:
    mean, spread, n = _mean_spread(values)
    if n == 0:
        return RECOVERY_FLAG if values else "–"
    text = f"{mean:.{digits}f}" + (f" ± {spread:.{digits}f}" if n > 1 else "")
    if n_expected is not None and n < n_expected:
        text += f" ({n}/{n_expected})"
    return text


def summarize(rows: list[dict]) -> dict:
    """Aggregates over seeds per task and method, and the headline counts for LoCA vs LoRA."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"])].append(r)
    per_task: dict[str, dict] = defaultdict(dict)
    for (task, method), rs in groups.items():
        agg = {"seeds": sorted(r["seed"] for r in rs)}
        for k in (
            *METRICS,
            "heldout_ce",
            "R_CE",
            "R_acc",
            "R_ceiling",
            "fit_wall_time_s",
            "time_to_best_s",
            "peak_memory_mb",
        ):
            mean, spread, n = _mean_spread([r[k] for r in rs])
            agg[k] = {"mean": mean, "std": spread, "n": n}
        per_task[task][method] = agg
    summary: dict = {"per_task": per_task}
    if any("loca" in m and "lora" in m for m in per_task.values()):
        summary["loca_vs_lora"] = versus_lora(per_task, rows, "loca")
    extra = [v for v in variants(rows) if v != "loca"]
    if extra:
        summary["variants_vs_lora"] = {v: versus_lora(per_task, rows, v) for v in extra}
    return summary


def versus_lora(per_task: dict, rows: list[dict], method: str) -> dict:
    """The headline counts of one LoCA configuration against LoRA and the frozen model, over the
    tasks where all three ran."""
    tasks = [t for t, m in per_task.items() if method in m and "lora" in m and "frozen" in m]
    mean = lambda t, m, k: per_task[t][m][k]["mean"]  # noqa: E731
    return {
        "tasks": tasks,
        "loca_ce_below_lora": sum(mean(t, method, "test_ce") < mean(t, "lora", "test_ce") for t in tasks),
        "loca_ce_below_frozen": sum(mean(t, method, "test_ce") < mean(t, "frozen", "test_ce") for t in tasks),
        "loca_acc_not_below_frozen": sum(mean(t, method, "acc") >= mean(t, "frozen", "acc") for t in tasks),
        "median_R_CE": _median([r["R_CE"] for r in rows if r["method"] == method]),
        "median_R_acc": _median([r["R_acc"] for r in rows if r["method"] == method]),
        "median_R_ceiling": _median([r["R_ceiling"] for r in rows if r["method"] == method]),
        "loca_wall_over_lora_wall": _median(
            [_wall(per_task[t], method) / _wall(per_task[t], "lora") for t in tasks]
        ),
    }


def headline(head: dict, name: str = "LoCA") -> str:
    """One line of :func:`versus_lora`'s counts for the console: ratios to 2 decimals
    (:data:`RECOVERY_FLAG` where every seed's ratio was flagged)."""
    ratio = lambda v: RECOVERY_FLAG if v is None else f"{v:.2f}"  # noqa: E731
    return (
        f"{name} vs LoRA: CE below LoRA in {head['loca_ce_below_lora']}/{len(head['tasks'])} tasks, "
        f"median R_CE {ratio(head['median_R_CE'])}, median R_acc {ratio(head['median_R_acc'])}"
        + (
            f", median R_ceiling {ratio(head['median_R_ceiling'])}"
            if head.get("median_R_ceiling") is not None
            else ""
        )
    )


def _wall(methods: dict, method: str) -> float:
    return methods[method]["fit_wall_time_s"]["mean"]


def _median(values) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def ceiling_label(rows: list[dict]) -> str | None:
    """Which Adapter-BP the R_ceiling of ``rows`` is against (None: no R_ceiling anywhere)."""
    used = [m for m in CEILINGS if any(r.get("ceiling_method") == m for r in rows)]
    if not used:
        return None
    return LABELS[used[0]] + "".join(f" where it ran, else {LABELS[m]}" for m in used[1:])


def table_markdown(rows: list[dict]) -> str:
    """Test CE and accuracy per task × method (mean ± sample std over seeds), R_CE and R_acc of
    LoCA against LoRA and R_ceiling against Adapter-BP, wall times; the best CE of a row in bold."""
    if not rows:
        return "No finished cells yet.\n"
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    cell = defaultdict(list)
    for r in rows:
        cell[(r["task"], r["method"])].append(r)
    model, device = rows[0]["model"], rows[0]["device"]
    n = rows[0]
    ceiling = ceiling_label([r for r in rows if r["method"] == "loca"])
    lines = [
        f"# {model}: " + " vs ".join(LABELS[m] for m in methods),
        "",
        f"Device {device}; {n['n_train']} train / {n['n_heldout']} held-out / {n['n_test']} test examples "
        f"per cell; seeds {', '.join(map(str, seeds))}; mean ± sample standard deviation over seeds. "
        f"R_CE and R_acc: LoCA against the same seed's LoRA ({RECOVERY_FLAG}: LoRA's gain too small "
        f"for a ratio: at most 1% of the frozen CE, one accuracy point or {RECOVERY_MIN_ITEMS} test "
        "items; (k/n): only k of n seeds had a ratio)."
        + (
            " R_ceiling: LoCA's CE gain over the frozen model's relative to that of its own adapters "
            "trained by backprop (Adapter-BP, the same seed; the predict-credit run where it ran)."
            if ceiling
            else ""
        ),
        "",
    ]

    def table(metric: str, title: str, lower_better: bool, digits: int, ratios: tuple[str, ...]) -> None:
        heads = {
            "R_CE": "R_CE (LoCA)",
            "R_acc": "R_acc (LoCA)",
            "R_ceiling": f"R_ceiling (LoCA vs {ceiling})",
        }
        extra = [
            e
            for e in ratios
            if "loca" in methods and (ceiling is not None if e == "R_ceiling" else "lora" in methods)
        ]
        lines.extend(
            [
                f"## {title}",
                "",
                "| task | "
                + " | ".join(LABELS[m] for m in methods)
                + "".join(f" | {heads[e]}" for e in extra)
                + " |",
                "|---|" + "---|" * (len(methods) + len(extra)),
            ]
        )
        for t in tasks:
            means = {m: _mean_spread([r[metric] for r in cell[(t, m)]])[0] for m in methods}
            finite = {m: v for m, v in means.items() if math.isfinite(v)}
            best = (min if lower_better else max)(finite, key=finite.get) if finite else None
            vals = []
            for m in methods:
                text = _fmt([r[metric] for r in cell[(t, m)]], digits)
                vals.append(f"**{text}**" if m == best and m != "frozen" else text)
            for e in extra:
                rs = cell[(t, "loca")]
                if e == "R_ceiling":  # only the seeds whose Adapter-BP ran
                    rs = [r for r in rs if r["ceiling_method"]]
                vals.append(_fmt([r[e] for r in rs], 2, n_expected=len(rs)))
            lines.append(f"| {t} | " + " | ".join(vals) + " |")
        lines.append("")

    table("test_ce", "Test CE per token (answer + EOS)", True, 3, ("R_CE", "R_ceiling"))
    table("test_ce_no_eos", "Test CE per token without EOS", True, 3, ())
    table("acc", "Test accuracy (acc)", False, 3, ("R_acc",))
    table("acc_norm", "Test accuracy (acc_norm)", False, 3, ())
    lines.extend(
        [
            "## Wall time (s): whole fit with its selection (LoCA: calibration included); "
            "time to the best held-out CE in brackets",
            "",
            "| task | " + " | ".join(LABELS[m] for m in methods if m != "frozen") + " |",
            "|---|" + "---|" * (len(methods) - 1),
        ]
    )
    for t in tasks:
        vals = []
        for m in methods:
            if m == "frozen":
                continue
            rs = cell[(t, m)]
            wall = _mean_spread([r["fit_wall_time_s"] for r in rs])[0]
            best = _mean_spread([r["time_to_best_s"] for r in rs])[0]
            vals.append(f"{wall:.0f} ({best:.0f})" if rs else "–")
        lines.append(f"| {t} | " + " | ".join(vals) + " |")
    if "loca" in methods:
        lines.extend(["", *time_to_loca_markdown(tasks, [m for m in methods if m != "frozen"], cell)])
    lines.extend(
        [
            "",
            f"Peak memory beyond the loaded model ({rows[0]['memory_kind']}, MB, mean over seeds):",
            "",
            "| task | " + " | ".join(LABELS[m] for m in methods) + " |",
            "|---|" + "---|" * len(methods),
        ]
    )
    for t in tasks:
        vals = [_fmt([r["peak_memory_mb"] for r in cell[(t, m)]], 0).split(" ±")[0] for m in methods]
        lines.append(f"| {t} | " + " | ".join(vals) + " |")
    if any(v != "loca" for v in variants(rows)):
        lines.extend(["", *variants_markdown(rows)])
    return "\n".join(lines) + "\n"


def time_to_loca_markdown(tasks: list[str], methods: list[str], cell: dict) -> list[str]:
    """Time to quality: per task, each method's seconds from its start to LoCA's selected held-out
    CE (LoCA: calibration included), mean over the seeds that reached it; "–" where none did, and
    (k/n) when only k of n seeds did."""
    lines = [
        "## Time (s) to LoCA's selected held-out CE, from the start (LoCA: calibration included)",
        "",
        "| task | " + " | ".join(LABELS[m] for m in methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for t in tasks:
        vals = []
        for m in methods:
            times = [r["time_to_loca_s"] for r in cell[(t, m)]]
            reached = [x for x in times if x is not None]
            text = f"{statistics.mean(reached):.0f}" if reached else "–"
            vals.append(
                text + (f" ({len(reached)}/{len(times)})" if reached and len(reached) < len(times) else "")
            )
        lines.append(f"| {t} | " + " | ".join(vals) + " |")
    return lines


def variants_markdown(rows: list[dict]) -> list[str]:
    """LoCA's configurations side by side (an ablation): held-out CE, which selects, then test
    CE and accuracy with their recovery ratios against LoRA (and Adapter-BP), and wall time."""
    names = variants(rows)
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cell = defaultdict(list)
    for r in rows:
        cell[(r["task"], r["method"])].append(r)
    mean = lambda t, m, k: _mean_spread([r[k] for r in cell[(t, m)]])[0]  # noqa: E731
    lines = ["## LoCA configurations (loca = this run's LoCA flags; loca@NAME = a variant)", ""]

    def table(title: str, metric: str, digits: int, extra: list[tuple[str, object]]) -> None:
        lines.extend(
            [
                f"### {title}",
                "",
                "| configuration | " + " | ".join(tasks) + "".join(f" | {h}" for h, _ in extra) + " |",
                "|---|" + "---|" * (len(tasks) + len(extra)),
            ]
        )
        for m in names:
            vals = [_fmt([r[metric] for r in cell[(t, m)]], digits) for t in tasks]
            vals += [f(m) for _, f in extra]
            lines.append(f"| {m} | " + " | ".join(vals) + " |")
        for ref in ("frozen", "lora"):
            if any(cell[(t, ref)] for t in tasks):
                vals = [_fmt([r[metric] for r in cell[(t, ref)]], digits) for t in tasks]
                lines.append(f"| *{LABELS[ref]}* | " + " | ".join(vals) + " |" + " |" * len(extra))
        lines.append("")

    def med(key):
        def f(m):
            v = _median([r[key] for r in rows if r["method"] == m])
            return "–" if v is None else f"{v:.2f}"

        return f

    def below_lora(m):
        ts = [t for t in tasks if cell[(t, m)] and cell[(t, "lora")]]
        return f"{sum(mean(t, m, 'test_ce') < mean(t, 'lora', 'test_ce') for t in ts)}/{len(ts)}"

    table("Held-out CE of the selected fit (what selection sees)", "heldout_ce", 3, [])
    ceiling = ceiling_label([r for r in rows if r["method"] in names])
    table(
        "Test CE per token (answer + EOS)",
        "test_ce",
        3,
        [("median R_CE", med("R_CE"))]
        + ([(f"median R_ceiling (vs {ceiling})", med("R_ceiling"))] if ceiling else [])
        + [("CE below LoRA", below_lora)],
    )
    table("Test CE per token without EOS", "test_ce_no_eos", 3, [])
    table("Test accuracy (acc)", "acc", 3, [("median R_acc", med("R_acc"))])
    table("Fit wall time (s), calibration and selection included", "fit_wall_time_s", 0, [])
    table("Best iteration", "best_step", 1, [])
    return lines


def write_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v for k, v in r.items()})
    return buf.getvalue()


def write_report(out: str | Path, cells: list[dict], log=print) -> dict:
    """Write ``results.json``, ``results.csv``, ``table.md`` and the PNG plots under ``out``."""
    out = Path(out)
    rows = rows_from_cells(cells)
    report = {"rows": rows, "summary": summarize(rows)}
    atomic_write_json(out / "results.json", jsonable(report))
    atomic_write_text(out / "results.csv", write_csv(rows))
    atomic_write_text(out / "table.md", table_markdown(rows))
    try:
        from .plots import write_plots
    except ImportError as exc:  # matplotlib is an optional extra
        log(f"plots skipped ({exc}); install loca[plot] and rerun to draw them from the stored cells")
    else:
        write_plots(out, cells, rows)
    return report
