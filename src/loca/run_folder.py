"""The folder a ``loca fit`` run writes as it goes: ``config.json``, ``maps/``, ``history.jsonl``,
``adapter/`` (the best snapshot, replaced atomically on every improvement), ``checkpoint/`` while
the fit runs and ``results.json`` at the end. Data-parallel runs write it from rank 0 only.

A rerun with ``--overwrite`` over an earlier run's files writes into a staging folder inside the
run folder and replaces the earlier files only once it has finished (:meth:`RunFolder.prepare`,
:meth:`RunFolder.replace`): a rerun that fails or is interrupted leaves the earlier run whole."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .infra.io import atomic_write_json, atomic_write_text, swap_in
from .infra.runs import prepare_run_dir, run_command
from .method.adapters import ResidualAdapters
from .method.artefacts import FIT_STATE_CONFIG, MAPS_CONFIG, read_json_object
from .method.maps import FeedbackMaps
from .method.run import RunWriter
from .method.state import FitState, load_fit_state, save_fit_state
from .models.parts import ModelParts

# what `loca fit` writes into its folder
RUN_FILES = ("config.json", "history.jsonl", "results.json", "adapter", "maps", "checkpoint")
STAGING = ".loca-staging-"  # the prefix of an --overwrite rerun's staging folder inside the run folder


class RunFolder(RunWriter):
    """A :class:`loca.method.run.RunWriter` that keeps the run folder ``out`` up to date.
    ``extra`` goes into every adapter config it writes (task, configuration); ``run`` into every
    fit state it saves (what a resume checks: model, data and settings fingerprints)."""

    def __init__(self, out: Path, extra: dict, history: list[dict] = (), run: dict | None = None):
        self.out, self.extra, self.run = Path(out), dict(extra), run
        self.lines = [json.dumps(r) for r in history]

    @staticmethod
    def prepare(out: Path, model: str, overwrite: bool) -> Path:
        """Check that a new run may write into ``out`` and return the folder it writes into:
        ``out`` itself, or, when ``out`` holds an earlier run's files (``overwrite``), a new
        staging folder inside it that :meth:`replace` swaps in once the run has finished, so that
        the earlier run stays whole if this one fails (:meth:`discard` removes the staging
        folder). Staging folders left by a killed rerun are removed here."""
        prepare_run_dir(out, "fit", model=model, overwrite=overwrite, writes=RUN_FILES)
        if not any(os.path.lexists(out / name) for name in RUN_FILES):
            return out
        for stale in out.glob(STAGING + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        return Path(tempfile.mkdtemp(dir=out, prefix=STAGING))

    @staticmethod
    def replace(out: Path, staging: Path) -> None:
        """Put a finished rerun's files (in ``staging``) in place of the earlier run's in ``out``:
        every name of :data:`RUN_FILES` is replaced or, where the rerun has none, removed (a
        symbolic link is removed as a link, its target untouched); nothing else in ``out`` is
        touched."""
        swap_in(staging, out, RUN_FILES)

    @staticmethod
    def discard(staging: Path) -> None:
        """Remove a failed rerun's staging folder."""
        shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def unfinished(out: Path | None) -> str | None:
        """Check that ``out`` holds an unfinished fit to resume; the maps it was given, if any."""
        if out is None:
            raise ValueError("resume needs the run folder (--out)")
        if run_command(out) != "fit" or not (out / "config.json").is_file():
            raise ValueError(f"--resume: {out} holds no `loca fit` run to continue")
        if (out / "results.json").is_file():
            raise ValueError(
                f"--resume: the run in {out} has finished (results.json is there); nothing to resume"
            )
        return read_json_object(out / "config.json").get("maps")

    @staticmethod
    def check_data(out: Path, data_fingerprint: str) -> None:
        """Refuse to resume the run in ``out`` on other training/held-out data than it started with
        (its ``config.json`` records their content fingerprint): its maps, fit state and frozen
        CE all belong to that data."""
        path = out / "config.json"
        saved = read_json_object(path).get("data_fingerprint")
        if saved is None:
            raise ValueError(
                f"{path}: records no data fingerprint (a run started by an older loca), so --resume "
                "cannot check that the data are the ones it started with; start it again with --overwrite"
            )
        if saved != data_fingerprint:
            raise ValueError(
                f"{path}: the training/held-out data changed since this run started (their content no "
                "longer matches the run's data fingerprint); it cannot be resumed on other data: start "
                "it again with --overwrite, or use another --out"
            )

    @staticmethod
    def saved_maps(out: Path) -> Path | None:
        """The maps an interrupted run calibrated before it stopped, if any."""
        return out / "maps" if (out / "maps" / MAPS_CONFIG).is_file() else None

    @staticmethod
    def saved_state(out: Path, parts: ModelParts, run: dict | None = None) -> FitState | None:
        """The fit state an interrupted run saved after its last completed iteration; None if it
        stopped before saving one. A ``checkpoint/`` that is there but partial, damaged, made for
        another model, data or settings (``run``, see :func:`loca.method.state.load_fit_state`),
        or that disagrees with ``history.jsonl`` is refused naming the file; so is a missing one
        when the history shows that one was saved: a resume never silently starts over."""
        ckpt, history = out / "checkpoint", out / "history.jsonl"
        rows = _read_history(history)
        if not os.path.lexists(ckpt):
            last = max((r["iteration"] for r in rows if isinstance(r.get("iteration"), int)), default=0)
            if last >= 2:  # the state after iteration `last - 1` was saved before these rows
                raise ValueError(
                    f"{ckpt} is missing but {history} reaches iteration {last}: the fit state was "
                    "lost, so the run cannot continue where it stopped; start it again with --overwrite"
                )
            return None
        state = load_fit_state(ckpt, parts, run)
        saved = [json.dumps(r) for r in state.history]
        on_disk = [json.dumps(r) for r in rows]
        later = on_disk[len(saved) :]
        if on_disk[: len(saved)] != saved or any(
            r.get("iteration") != state.iteration + 1 for r in rows[len(saved) :]
        ):
            raise ValueError(
                f"{ckpt / FIT_STATE_CONFIG}: its history (to iteration {state.iteration}) does not "
                f"match {history} ({len(on_disk)} rows, {len(later)} after the state's): the fit "
                "state belongs to another run or was edited; it cannot be resumed"
            )
        return state

    def config(self, record: dict) -> None:
        atomic_write_json(self.out / "config.json", record)

    def maps(self, maps: FeedbackMaps, calibrated: bool) -> None:
        super().maps(maps, calibrated)
        self.extra["feedback_rank"] = maps.rank
        if calibrated:
            maps.save_pretrained(self.out / "maps")

    def history(self) -> None:
        atomic_write_text(self.out / "history.jsonl", "\n".join(self.lines) + "\n")

    def iteration(self, row: dict) -> None:
        self.lines.append(json.dumps(row))
        self.history()

    def improved(self, adapters: ResidualAdapters, row: dict) -> None:
        adapters.save_pretrained(self.out / "adapter", extra={**self.extra, "selection": row})

    def checkpoint(self, state: FitState) -> None:
        save_fit_state(state, self.out / "checkpoint", self.run)

    def finish(self, adapters: ResidualAdapters, selection: dict | None, results: dict) -> None:
        """The final adapter (with its selection and test metrics), ``results.json``; the
        checkpoint goes."""
        metrics = {k: results[k] for k in ("frozen", "loca")}
        adapters.save_pretrained(
            self.out / "adapter", extra={**self.extra, "selection": selection, "metrics": metrics}
        )
        atomic_write_json(self.out / "results.json", results)
        shutil.rmtree(self.out / "checkpoint", ignore_errors=True)


def _read_history(path: Path) -> list[dict]:
    """The rows of a run's ``history.jsonl`` (none if it is not there); a line that is not a JSON
    object is an error naming the file and line."""
    if not path.is_file():
        return []
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: not a JSON object (a damaged history); the run cannot be resumed")
        rows.append(row)
    return rows
