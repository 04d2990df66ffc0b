"""Where examples come from: local JSON Lines files (strictly validated) or the Hugging Face hub.

Local files use loca's JSON Lines schema (docs/tasks.md; one JSON object per line)::

    {"id": str, "question": str, "passage": str | null, "choices": [str, ...], "label": int}

``question``, ``choices`` and ``label`` are required; ``id`` (default ``<file stem>-<line>``) and
``passage`` (default null) may be left out. Any defect -- a line that is empty or not a JSON
object, a missing or unknown key, a wrong type, an empty string, a label out of range, a
duplicate id -- raises :class:`DataError` naming the file and line. Nothing is dropped silently.

Hub rows are mapped to the same schema by each task's pure function (``task.hub.to_example``, see
:mod:`loca.data.tasks`; :func:`hub_row_to_example`), so a hub row and the corresponding local line
give identical :class:`Example` objects.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from .schema import Example
from .tasks import TASKS, Task

DATA_DIR_ENV = "LOCA_DATA_DIR"
PARQUET_REVISION = "refs/convert/parquet"
REQUIRED_KEYS = ("question", "choices", "label")
OPTIONAL_KEYS = ("id", "passage")


class DataError(ValueError):
    """An input item is malformed. ``path`` and ``line`` (1-based) say where."""

    def __init__(self, message: str, path: str | Path | None = None, line: int | None = None):
        self.path = None if path is None else str(path)
        self.line = line
        where = ""
        if self.path is not None:
            where = f"{self.path}:{line}: " if line is not None else f"{self.path}: "
        super().__init__(where + message)


class DataNotFoundError(FileNotFoundError):
    """A task's split could be found neither locally nor on the hub."""


# --- local JSON Lines ------------------------------------------------------------------------


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def parse_item(obj, default_id: str) -> Example:
    """Validate one decoded JSON value and build an :class:`Example` (raises ``ValueError``)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {_type_name(obj)}")
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    unknown = sorted(set(obj) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)}"
        )
    question, choices, label = obj["question"], obj["choices"], obj["label"]
    passage, ex_id = obj.get("passage"), obj.get("id", default_id)
    if not isinstance(question, str):
        raise ValueError(f"field 'question' must be a string, got {_type_name(question)}")
    if not question.strip():
        raise ValueError("field 'question' is empty")
    if passage is not None and not isinstance(passage, str):
        raise ValueError(f"field 'passage' must be a string or null, got {_type_name(passage)}")
    if not isinstance(ex_id, str):
        raise ValueError(f"field 'id' must be a string, got {_type_name(ex_id)}")
    if not isinstance(choices, list):
        raise ValueError(f"field 'choices' must be a list of strings, got {_type_name(choices)}")
    if not choices:
        raise ValueError("field 'choices' is empty")
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            raise ValueError(f"choices[{i}] must be a string, got {_type_name(c)}")
        if not c.strip():
            raise ValueError(f"choices[{i}] is empty")
    if isinstance(label, bool) or not isinstance(label, int):
        raise ValueError(f"field 'label' must be an integer, got {_type_name(label)}")
    if not 0 <= label < len(choices):
        raise ValueError(f"label {label} out of range for {len(choices)} choices")
    return Example(question=question, choices=tuple(choices), label=label, passage=passage, id=ex_id)


def load_local(path: str | Path) -> list[Example]:
    """Read a JSON Lines file in loca's schema, validating every line strictly (blank lines at
    the end of the file are no lines; a blank line before an item is an error)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    while lines and not lines[-1].strip():  # the final newline, and blank lines after the last item
        lines.pop()
    examples: list[Example] = []
    first_line: dict[str, int] = {}
    for n, bline in enumerate(lines, start=1):
        try:
            text = bline.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"not valid UTF-8 ({exc.reason})", path, n) from None
        if not text.strip():
            raise DataError("empty line (every line must hold one JSON object)", path, n)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"not valid JSON ({exc.msg} at column {exc.colno})", path, n) from None
        try:
            ex = parse_item(obj, default_id=f"{path.stem}-{n}")
        except ValueError as exc:
            raise DataError(str(exc), path, n) from None
        if ex.id in first_line:
            raise DataError(f"duplicate id {ex.id!r} (first on line {first_line[ex.id]})", path, n)
        first_line[ex.id] = n
        examples.append(ex)
    if not examples:
        raise DataError("no examples (the file is empty)", path)
    return examples


def hub_row_to_example(task: Task | str, row: Mapping, split: str = "validation", index: int = 0) -> Example:
    """Map one hub row of a task (a registry name, or a task with a hub source) to loca's schema.

    ``split`` is the *local* split name and ``index`` the row's position in its split; both only
    build ids for tasks whose source has none (``<task>-<split>-<index>``, as in the local files).
    """
    name = task if isinstance(task, str) else task.name
    found = TASKS.get(task) if isinstance(task, str) else task
    if found is None or found.hub is None:
        hub_tasks = ", ".join(t.name for t in TASKS.values() if t.hub is not None)
        raise ValueError(f"task {name!r} has no hub mapping; hub tasks: {hub_tasks}")
    return found.hub.to_example(row, split, index)


# --- resolving a task's split ----------------------------------------------------------------


def resolve_data_dir(data_dir: str | Path | None) -> str | Path | None:
    """``data_dir`` if given, else ``$LOCA_DATA_DIR`` if set, else None (the Hugging Face hub):
    the one place the variable is read. The CLI records the result in a run's configuration as
    given; nothing else is searched."""
    return data_dir or os.environ.get(DATA_DIR_ENV) or None


def data_dir_or_env(data_dir: str | Path | None) -> Path | None:
    """:func:`resolve_data_dir` as a Path."""
    root = resolve_data_dir(data_dir)
    return None if root is None else Path(root)


def local_folder(task: Task, data_dir: str | Path | None = None) -> Path | None:
    """The folder holding the task's local split files, or None when the hub is to be used."""
    if task.path is not None:
        p = Path(task.path)
        return p if p.is_dir() else p.parent
    root = data_dir_or_env(data_dir)
    if root is None or task.folder is None:
        return None
    folder = root / task.folder
    return folder if folder.is_dir() else None


def split_file(task: Task, split: str, data_dir: str | Path | None = None) -> Path | None:
    """The local file of ``split`` (which may not exist); None when there is none to look at."""
    if task.path is not None and Path(task.path).is_file():  # a user file is its only split
        return Path(task.path) if split == task.validation_split else None
    folder = local_folder(task, data_dir)
    return None if folder is None else folder / f"{split}.jsonl"


def source_kind(task: Task, data_dir: str | Path | None = None) -> str:
    """``"local"`` when the task's folder (or user file) exists, else ``"hub"``."""
    return "local" if local_folder(task, data_dir) is not None else "hub"


def has_split(task: Task, split: str | None, data_dir: str | Path | None = None) -> bool:
    """Whether ``split`` is available from the task's source (without loading it)."""
    if split is None:
        return False
    if source_kind(task, data_dir) == "local":
        f = split_file(task, split, data_dir)
        return f is not None and f.is_file()
    return (
        task.hub is not None
        and split in (task.train_split, task.validation_split)
        and (split != task.train_split or task.hub.train_split is not None)
    )


def describe_source(task: Task, data_dir: str | Path | None = None) -> dict:
    if source_kind(task, data_dir) == "local":
        return {"kind": "local", "folder": str(local_folder(task, data_dir))}
    return {
        "kind": "hub",
        "path": task.hub.path if task.hub else None,
        "name": task.hub.name if task.hub else None,
    }


def _looked_at(task: Task, data_dir: str | Path | None) -> str:
    root = data_dir_or_env(data_dir)
    if task.path is not None:
        return str(task.path)
    if root is None:
        return f"no local data folder (neither data_dir nor ${DATA_DIR_ENV} is set)"
    return f"{root / (task.folder or task.name)} (not a folder)"


def load_task_split(task: Task, split: str, data_dir: str | Path | None = None) -> list[Example]:
    """Load one split of a task as examples.

    Local data is used when ``data_dir`` (or ``$LOCA_DATA_DIR``) holds the task's folder
    (``<data_dir>/<folder>/<split>.jsonl``); a user task reads its own file or folder. Otherwise
    the split is loaded from the Hugging Face hub with ``datasets`` (cache first; nothing is
    downloaded when ``HF_HUB_OFFLINE=1``) and mapped with :func:`hub_row_to_example`.
    """
    if source_kind(task, data_dir) == "local":
        f = split_file(task, split, data_dir)
        if f is None or not f.is_file():
            folder = local_folder(task, data_dir)
            if task.path is not None and Path(task.path).is_file():
                raise DataNotFoundError(
                    f"user task {task.name!r} ({task.path}) has one split, "
                    f"{task.validation_split!r}; there is no split {split!r}"
                )
            present = sorted(p.stem for p in folder.glob("*.jsonl"))
            raise DataNotFoundError(
                f"task {task.name!r}: split {split!r} not found at {f}; splits present in "
                f"{folder}: {', '.join(present) or 'none'}"
            )
        return load_local(f)
    return load_hub_split(task, split, looked_at=_looked_at(task, data_dir))


def load_hub_split(task: Task, split: str, looked_at: str = "") -> list[Example]:
    """Load a split from the hub (``split`` is the local split name; it is mapped to the hub's)."""
    where = f"looked locally at: {looked_at}" if looked_at else ""
    if task.hub is None:
        raise DataNotFoundError(f"task {task.name!r} has no hub source; {where}")
    hub_split = {
        task.train_split: task.hub.train_split,
        task.validation_split: task.hub.validation_split,
    }.get(split, split)
    if hub_split is None:
        raise DataNotFoundError(f"task {task.name!r} has no hub split for {split!r}")
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        import datasets
    except ImportError:
        raise DataNotFoundError(
            f"task {task.name!r}: no local data ({where}) and loading {task.hub} from the hub "
            "needs the 'datasets' package (pip install 'loca[hub]'); or pass --data-dir / set "
            f"${DATA_DIR_ENV} to a folder holding {task.folder}/{split}.jsonl"
        ) from None
    try:
        try:
            ds = datasets.load_dataset(task.hub.path, task.hub.name, split=hub_split)
        except RuntimeError as exc:
            # datasets >= 4 runs no loading scripts; the hub's parquet export still loads.
            if "scripts are no longer supported" not in str(exc):
                raise
            ds = datasets.load_dataset(
                task.hub.path, task.hub.name, split=hub_split, revision=PARQUET_REVISION
            )
    except Exception as exc:  # noqa: BLE001 - any hub/cache failure is reported the same way
        hint = " (HF_HUB_OFFLINE=1 is set, so only the local cache was tried)" if offline else ""
        raise DataNotFoundError(
            f"task {task.name!r}, split {split!r}: {where}; hub {task.hub} split {hub_split!r} "
            f"could not be loaded{hint}: {type(exc).__name__}: {exc}. Pass --data-dir or set "
            f"${DATA_DIR_ENV} to a folder holding {task.folder}/{split}.jsonl"
        ) from None
    out = []
    for i, row in enumerate(ds):
        try:
            out.append(hub_row_to_example(task, row, split=split, index=i))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"row {i}: {type(exc).__name__}: {exc}", f"hub:{task.hub}/{hub_split}") from None
    if not out:
        raise DataError("no examples", f"hub:{task.hub}/{hub_split}")
    return out
