"""The folder a ``loca fit`` run writes as it goes: ``config.json``, ``maps/``, ``history.jsonl``,
``adapter/`` (the best snapshot, replaced atomically on every improvement), ``checkpoint/`` while
the fit runs and ``results.json`` at the end. Data-parallel runs write it from rank 0 only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .infra.io import atomic_write_json, atomic_write_text, is_artefact
from .infra.runs import prepare_run_dir, run_command
from .method.adapters import ResidualAdapters
from .method.artefacts import CONFIG_NAMES, FIT_STATE_CONFIG, FIT_STATE_FORMAT, MAPS_CONFIG, MAPS_FORMAT
from .method.maps import FeedbackMaps
from .method.run import RunWriter
from .method.state import FitState, load_fit_state, save_fit_state
from .models.parts import ModelParts

# what `loca fit` writes into its folder
RUN_FILES = ("config.json", "history.jsonl", "results.json", "adapter", "maps", "checkpoint")


class RunFolder(RunWriter):
    """A :class:`loca.method.run.RunWriter` that keeps the run folder ``out`` up to date.
    ``extra`` goes into every adapter config it writes (task, configuration)."""

    def __init__(self, out: Path, extra: dict, history: list[dict] = ()):
        self.out, self.extra = Path(out), dict(extra)
        self.lines = [json.dumps(r) for r in history]

    @staticmethod
    def prepare(out: Path, model: str, overwrite: bool) -> None:
        """Check that a new run may write into ``out``; a finished earlier fit there is cleared
        (with ``overwrite``), so that a failed rerun never leaves a config describing another run
        than the results beside it."""
        rerun = run_command(out) == "fit"
        prepare_run_dir(out, "fit", model=model, overwrite=overwrite, writes=RUN_FILES)
        if rerun:
            for name in ("results.json", "history.jsonl", "config.json"):
                (out / name).unlink(missing_ok=True)
            for sub, cfg_file, fmt in (
                ("adapter", CONFIG_NAMES, "loca-adapter"),
                ("maps", MAPS_CONFIG, MAPS_FORMAT),
                ("checkpoint", FIT_STATE_CONFIG, FIT_STATE_FORMAT),
            ):
                if is_artefact(out / sub, cfg_file, fmt):
                    shutil.rmtree(out / sub)

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
        return json.loads((out / "config.json").read_text()).get("maps")

    @staticmethod
    def saved_maps(out: Path) -> Path | None:
        """The maps an interrupted run calibrated before it stopped, if any."""
        return out / "maps" if is_artefact(out / "maps", MAPS_CONFIG, None) else None

    @staticmethod
    def saved_state(out: Path, parts: ModelParts) -> FitState | None:
        """The fit state an interrupted run saved after its last completed iteration, if any."""
        if not is_artefact(out / "checkpoint", FIT_STATE_CONFIG, FIT_STATE_FORMAT):
            return None
        return load_fit_state(out / "checkpoint", parts)

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
        save_fit_state(state, self.out / "checkpoint")

    def finish(self, adapters: ResidualAdapters, selection: dict | None, results: dict) -> None:
        """The final adapter (with its selection and test metrics), ``results.json``; the
        checkpoint goes."""
        metrics = {k: results[k] for k in ("frozen", "loca")}
        adapters.save_pretrained(
            self.out / "adapter", extra={**self.extra, "selection": selection, "metrics": metrics}
        )
        atomic_write_json(self.out / "results.json", results)
        shutil.rmtree(self.out / "checkpoint", ignore_errors=True)
