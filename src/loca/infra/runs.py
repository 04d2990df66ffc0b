"""Run folders: where a command may write, so that a user's files and a model's folder are never
overwritten.

A run folder carries a marker naming the command that made it. A command writes into ``--out``
only if it is new or empty, or a run folder of the same command that may be continued
(``resumable``, e.g. ``loca compare``) or replaced (``--overwrite``). ``--overwrite`` also lets a
command write its own files into a folder that holds other files; nothing there is deleted.
A model folder is never written to. A command that continues its folder (``loca compare``)
holds :class:`RunLock` on it while it runs, so a second process on the same folder is refused.
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
from pathlib import Path

from .io import atomic_write_json

MARKER = ".loca-run.json"
LOCK = ".loca-lock"


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
    # a folder holding only the marker (and lock file) is a run that failed before writing anything
    if out.is_dir() and any(p.name not in (MARKER, LOCK) for p in out.iterdir()):
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


class RunLock:
    """An exclusive lock on a run folder (``fcntl.flock`` on its ``.loca-lock`` file) for one
    process: a second one gets :class:`RunFolderError` at once, naming the process that holds it.
    Released by :meth:`release` (or leaving the ``with`` body), and by the kernel when the process
    ends in any way, SIGKILL included: a killed run never leaves a stale lock. The lock file stays
    (removing it would let two processes lock two different files)."""

    def __init__(self, out: str | Path, command: str):
        self.path = Path(out) / LOCK
        self.command = command
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunFolderError(f"cannot lock --out {self.path.parent}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunFolderError(f"cannot lock --out {self.path.parent}: {exc.strerror or exc}") from exc
            raise RunFolderError(
                f"--out {self.path.parent} is in use by another `loca {self.command}` ({holder}); wait "
                "for it to finish, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the lock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    """Who holds a lock, as its file says."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        return f"process {int(info['pid'])} on {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


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
