"""Atomic file and folder writes, so an interrupted run never leaves a half-written artefact."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the body has finished, then deliver them: a file swap and its
    clean-up are never cut half-way. (Main thread only; elsewhere signals cannot be handled.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    wanted = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in wanted}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in received:
            signal.raise_signal(s)


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with deferred_signals():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def atomic_write_json(path: str | Path, obj) -> None:
    """Strict JSON (no bare NaN/Infinity, which other parsers reject), written atomically."""
    try:
        text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False)
    except ValueError as exc:
        raise ValueError(f"refusing to write {path}: it would hold a non-finite number ({exc})") from exc
    atomic_write_text(path, text + "\n")


def swap_in(new: str | Path, into: str | Path, names: tuple[str, ...]) -> None:
    """Replace the entries ``names`` of the folder ``into`` with those of ``new`` (an entry that
    ``new`` lacks is removed from ``into``), then remove ``new``. ``new`` must be on the same file
    system (e.g. inside ``into``): every step is a rename. The old entries are moved aside first and
    deleted only once every new one is in place; if a rename fails they are put back. A symbolic
    link among them is moved and removed as a link (its target is never touched). Ctrl-C and
    SIGTERM wait until the swap is done."""
    new, into = Path(new), Path(into)
    with deferred_signals():
        aside = Path(tempfile.mkdtemp(dir=into, prefix=".loca-replaced-"))
        moved_aside: list[str] = []
        moved_in: list[str] = []
        try:
            for name in names:
                if os.path.lexists(into / name):
                    os.replace(into / name, aside / name)
                    moved_aside.append(name)
            for name in names:
                if os.path.lexists(new / name):
                    os.replace(new / name, into / name)
                    moved_in.append(name)
        except BaseException:
            for name in moved_in:
                os.replace(into / name, new / name)
            for name in moved_aside:
                os.replace(aside / name, into / name)
            shutil.rmtree(aside, ignore_errors=True)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        shutil.rmtree(new, ignore_errors=True)


class FolderInUseError(FileExistsError):
    """A folder holds something loca did not make and must not replace."""


def is_artefact(directory: Path, config_file: str | tuple[str, ...], fmt: str | None) -> bool:
    """Whether ``directory`` holds a loca artefact of format ``fmt`` (its ``config_file``, or one of
    several names, says so; with ``fmt=None`` the file's presence is enough)."""
    names = (config_file,) if isinstance(config_file, str) else config_file
    for name in names:
        if fmt is None:
            if (directory / name).is_file():
                return True
            continue
        try:
            if json.loads((directory / name).read_text()).get("format") == fmt:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def ensure_replaceable(directory: Path, config_file: str | tuple[str, ...], fmt: str | None) -> None:
    """Raise :class:`FolderInUseError` unless ``directory`` is absent, empty, or an artefact of the
    same kind (which :func:`atomic_dir` may replace)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FolderInUseError(f"{directory} exists and is not a folder")
    if directory.is_dir() and any(directory.iterdir()) and not is_artefact(directory, config_file, fmt):
        raise FolderInUseError(
            f"{directory} is not empty and is not a loca {fmt or 'artefact'} folder; refusing to "
            "replace it (choose a new or empty folder)"
        )


@contextmanager
def atomic_dir(directory: str | Path, config_file: str | tuple[str, ...], fmt: str | None) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``directory`` in one rename.

    An existing ``directory`` is replaced only if it is empty or is an artefact of the same kind
    (``config_file`` naming format ``fmt``): loca never replaces a folder it did not make. If the
    swap fails half-way the old copy is put back.
    """
    directory = Path(directory)
    ensure_replaceable(directory, config_file, fmt)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    old = directory.with_name(f".{directory.name}.old")
    try:
        yield tmp
        with deferred_signals():  # the swap and its clean-up run to the end
            if not directory.exists():
                os.replace(tmp, directory)
                return
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            try:
                os.replace(tmp, directory)
            except BaseException:
                os.replace(old, directory)  # put the previous artefact back
                raise
            shutil.rmtree(old, ignore_errors=True)
    finally:
        with deferred_signals():
            shutil.rmtree(tmp, ignore_errors=True)
