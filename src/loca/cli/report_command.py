"""Tables and plots over one or several `loca fit` run folders.

Example::

    loca report runs/sst2 runs/sst2-fixed --out runs/report

Reads each run's ``config.json``, ``history.jsonl`` and ``results.json`` (no model is loaded) and
writes ``report.md`` (a table, one row per run, and the plots), ``report.json`` (the table's rows
as data), ``heldout_ce.png`` (held-out CE against iteration for every trajectory, the frozen CE
and the selected point) and ``alignment.png`` (the fitted maps' per-block alignment on the probe
and the held-out probe, against a random map's); prints the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..eval.run_report import FILES, read_runs, write_report
from ..infra.runs import prepare_run_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="`loca fit --out` folders")
    p.add_argument("--out", required=True, help="output folder; receives " + ", ".join(FILES))
    p.add_argument("--overwrite", action="store_true", help="replace an earlier `loca report` in --out")


def run(args: argparse.Namespace) -> int:
    runs = read_runs(args.runs)
    out = prepare_run_dir(args.out, "report", overwrite=args.overwrite, writes=FILES)
    print(write_report(out, runs))
    print(f"wrote {', '.join(str(Path(out) / name) for name in FILES)}")
    return 0
