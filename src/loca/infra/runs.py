"""Run folders: where a command may write, so that a user's files and a model's folder are never
overwritten.

A run folder carries a marker naming the command that made it. A command writes into ``--out``
only if it is new or empty, or a run folder of the same command that may be continued
(``resumable``, e.g. ``loca compare``) or replaced (``--overwrite``). ``--overwrite`` also lets a
command write its own files into a folder that holds other files; nothing there is deleted.
A model folder is never written to.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .io import atomic_write_json

MARKER = ".loca-run.json"


class RunFolderError(ValueError):
    """``--out`` may not receive this command's files."""


def run_command(folder: Path) -> str | None:
    """The command whose run folder ``folder`` is (its marker, or the ``command`` of the
    ``config.json`` that ``fit`` and ``compare`` write), else None."""
    for name in (MARKER, "config.json"):
        try:
            command = json.loads((folder / name).read_text()).get("command")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(command, str):
            return command
    return None


def is_model_folder(folder: Path) -> bool:
    """A Hugging Face model folder: a ``config.json`` naming an architecture or model type."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and ("model_type" in cfg or "architectures" in cfg)


def refuse_model_folder(out: Path, model: str | Path | None) -> None:
    """Raise :class:`RunFolderError` if ``out`` is a model folder or lies inside ``model``'s."""
    if model is not None and Path(model).is_dir():
        m, o = Path(model).resolve(), out.resolve()
        if o == m or m in o.parents:
            raise RunFolderError(f"--out {out} is inside the model folder {model}; loca never writes there")
    if out.is_dir() and is_model_folder(out):
        raise RunFolderError(f"--out {out} is a model folder; loca never writes there (choose another --out)")


def prepare_run_dir(
    out: str | Path,
    command: str,
    *,
    model: str | Path | None = None,
    overwrite: bool = False,
    resumable: bool = False,
    writes: tuple[str, ...] = (),
) -> Path:
    """Check that ``out`` may receive ``command``'s files, then create and mark it.

    Raises :class:`RunFolderError` (before any work is done) when ``out`` is or lies inside the
    model's folder, is any model's folder, or is not empty and neither a new run folder of this
    command nor allowed by ``overwrite``/``resumable``; ``overwrite`` into a folder that is not a
    run folder is refused too when it holds any of the names in ``writes`` (the files and folders
    the command writes), so nothing of the user's is replaced. Creating the folder and its marker first
    also makes a read-only or full disk fail here, not after the run."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} exists and is not a folder")
    refuse_model_folder(out, model)
    # a folder holding only the marker is a run that failed before writing anything
    if out.is_dir() and any(p.name != MARKER for p in out.iterdir()):
        found = run_command(out)
        if found == command and resumable:
            pass
        elif found == command and not overwrite:
            raise RunFolderError(
                f"--out {out} already holds a `loca {command}` run; pass --overwrite to replace its "
                "results, or choose another --out"
            )
        elif found not in (None, command):
            raise RunFolderError(
                f"--out {out} holds a `loca {found}` run, not a `loca {command}` run; choose another --out"
            )
        elif found is None and not overwrite:
            raise RunFolderError(
                f"--out {out} is not empty and is not a loca run folder; choose a new or empty "
                "folder, or pass --overwrite to add this run's files to it (nothing there is deleted)"
            )
        elif found is None:
            clash = sorted(name for name in writes if (out / name).exists())
            if clash:
                raise RunFolderError(
                    f"--out {out} is not a loca run folder and already holds {', '.join(clash)}, which "
                    f"`loca {command}` would replace; choose a new or empty folder"
                )
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / MARKER, {"command": command})
    except OSError as exc:
        raise RunFolderError(f"cannot write to --out {out}: {exc.strerror or exc}") from exc
    return out


def require_finite(metrics: dict, what: str) -> None:
    """Raise ValueError naming the metrics of ``what`` that are NaN or infinite (a standard error
    is undefined, not wrong, for a single example: see :func:`undefined_as_none`)."""
    bad = [
        k
        for k, v in metrics.items()
        if isinstance(v, float) and not math.isfinite(v) and not k.endswith("_stderr")
    ]
    if bad:
        raise ValueError(
            f"{what} produced non-finite {', '.join(bad)}: the model or adapters give NaN/Inf "
            "logits (check the weights, the adapter file and the dtype); nothing was written"
        )


def undefined_as_none(metrics: dict) -> dict:
    """``metrics`` with undefined (non-finite) standard errors as None, for strict JSON."""
    return {
        k: None if k.endswith("_stderr") and isinstance(v, float) and not math.isfinite(v) else v
        for k, v in metrics.items()
    }
