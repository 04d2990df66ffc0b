"""Where a comparison keeps its finished cells, and when a stored cell may be reused.

A cell is one method on one task and seed. It is stored as ``cells/<task>/seed<seed>/<method>.json``
holding its full configuration (the *key*: model fingerprint, data and split record, the content
hash of the cell's examples, method configuration, evaluation settings, device type and package
versions), its metrics and its held-out history. A stored cell is reused only when its key equals
the key the current run would write, so an interrupted comparison continues where it stopped and a
changed setting, or data edited under the same ids, recomputes exactly the cells it affects.

The cells of one folder are one comparison: the same model, sizes and evaluation settings (the
*scope*, :data:`SCOPE`), and within a task and seed the same data. :meth:`CellStore.report_cells`
refuses a folder that mixes comparisons; a file that is not a cell is an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from ..infra.io import atomic_write_json

CELLS = "cells"
SCOPE = ("model", "fingerprint", "dtype", "device_map", "sizes", "evaluation")
"""The parts of a cell's key that every cell of one comparison shares: a cell that differs in one
belongs to another comparison."""

_TOP = (
    "task",
    "seed",
    "method",
    "key",
    "fit",
    "test",
    "device",
    "wall_time_s",
    "peak_memory_mb",
    "memory_kind",
)
_FIT = (
    "heldout_ce",
    "frozen_heldout_ce",
    "selected",
    "best_step",
    "step_unit",
    "improved",
    "time_to_best_s",
    "wall_time_s",
    "history",
)
_NUMBERS = {  # read as numbers by the report (None: a non-finite value, stored as null)
    "fit": ("heldout_ce", "frozen_heldout_ce", "best_step", "time_to_best_s", "wall_time_s"),
    "test": ("test_ce", "acc", "test_ce_no_eos", "acc_norm"),
}
_HISTORY = ("step", "heldout_ce", "elapsed_s", "candidate")


def digest(obj) -> str:
    """sha256 of a JSON-serialisable object (keys sorted), e.g. a split record."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def jsonable(obj):
    """``obj`` with non-finite floats as None (strict JSON) and tuples as lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def scope(key: dict) -> dict:
    """The :data:`SCOPE` of a cell key, as stored (JSON)."""
    return jsonable({k: key.get(k) for k in SCOPE})


def scope_difference(ours: dict, theirs: dict) -> str:
    """What differs between two scopes, in words (``ours`` first)."""

    def short(v) -> str:
        text = json.dumps(v, sort_keys=True)
        return text if len(text) <= 60 else text[:57] + "..."

    return "; ".join(
        f"{k} {short(ours.get(k))} here, {short(theirs.get(k))} there"
        for k in SCOPE
        if ours.get(k) != theirs.get(k)
    )


class CellError(ValueError):
    """A file under ``cells/`` that is not a readable cell."""


def _number(v) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool))


def _problem(cell, path: Path) -> str | None:
    """Why ``cell`` (read from ``path``) is not a cell, or None."""
    kind = {dict: "an object", list: "a list", str: "a string"}
    if not isinstance(cell, dict):
        return f"holds {kind.get(type(cell), type(cell).__name__)}, not a cell object"
    missing = [k for k in _TOP if k not in cell]
    if missing:
        return f"has no {', '.join(map(repr, missing))}"
    for part in ("key", "fit", "test"):
        if not isinstance(cell[part], dict):
            return f"its {part!r} is {kind.get(type(cell[part]), type(cell[part]).__name__)}, not an object"
    missing = [k for k in _FIT if k not in cell["fit"]]
    if missing:
        return f"its 'fit' has no {', '.join(map(repr, missing))}"
    sizes = cell["key"].get("sizes")
    if "model" not in cell["key"] or not isinstance(sizes, dict):
        return "its 'key' has no 'model' or no 'sizes' object"
    if any(k not in sizes for k in ("n_train", "n_heldout", "n_test")):
        return "its key's 'sizes' lack n_train, n_heldout or n_test"
    for part, names in _NUMBERS.items():
        bad = [k for k in names if not _number(cell[part].get(k))]
        if bad:
            return f"its {part!r} has a non-number {', '.join(map(repr, bad))}"
    if not all(_number(cell[k]) for k in ("wall_time_s", "peak_memory_mb")):
        return "its 'wall_time_s' or 'peak_memory_mb' is not a number"
    history = cell["fit"]["history"]
    if not isinstance(history, list) or not all(
        isinstance(r, dict) and all(k in r for k in _HISTORY) for r in history
    ):
        return f"its fit's 'history' is not a list of rows with {', '.join(_HISTORY)}"
    task, seed, method = cell["task"], cell["seed"], cell["method"]
    if not isinstance(seed, int) or isinstance(seed, bool):
        return f"its 'seed' {seed!r} is not an integer"
    where = (path.parent.parent.name, path.parent.name, path.stem)
    if (str(task), f"seed{seed}", str(method)) != where:
        return f"it is the cell of task {task!r} seed {seed} method {method!r}, not of the place it is stored"
    return None


def read_cell(path: Path) -> dict:
    """The cell stored at ``path``; :class:`CellError` naming the file if it is not one."""
    try:
        cell = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        problem = f"not readable JSON ({exc})"
    else:
        problem = _problem(cell, path)
        if problem is None:
            return cell
    raise CellError(
        f"{path}: not a `loca compare` cell: {problem}; move it away or delete it (a rerun "
        "recomputes the cell)"
    )


class CellStore:
    """The cells of one comparison folder."""

    def __init__(self, out: str | Path):
        self.root = Path(out)

    def path(self, task: str, seed: int, method: str) -> Path:
        return self.root / CELLS / task / f"seed{seed}" / f"{method}.json"

    def lookup(self, task: str, seed: int, method: str, key: dict) -> tuple[dict | None, str]:
        """``(the stored cell, "reuse")`` if its key equals ``key`` (compared as JSON), else
        ``(None, why)``: ``"new"`` (none stored), ``"data"`` (made from other data: the same
        examples by id, other content) or ``"config"`` (any other part of the key differs)."""
        path = self.path(task, seed, method)
        if not path.is_file():
            return None, "new"
        cell = read_cell(path)
        old, new = cell["key"], jsonable(key)
        if old == new:
            return cell, "reuse"
        if scope(old) != scope(new):
            return None, "config"
        if old.get("data_sha256") is not None and old.get("data_sha256") != new.get("data_sha256"):
            return None, "data"
        return None, "config"

    def load(self, task: str, seed: int, method: str, key: dict) -> dict | None:
        """The stored cell if its key equals ``key``, else None."""
        return self.lookup(task, seed, method, key)[0]

    def save(self, task: str, seed: int, method: str, key: dict, cell: dict) -> None:
        atomic_write_json(self.path(task, seed, method), jsonable({"key": key, **cell}))

    def stored(self) -> list[tuple[Path, dict]]:
        """Every stored ``(path, cell)``, in a stable order; a file that is not a cell is an
        error naming it."""
        return [(path, read_cell(path)) for path in sorted((self.root / CELLS).glob("*/seed*/*.json"))]

    def all_cells(self) -> list[dict]:
        """Every stored cell, in a stable order."""
        return [cell for _, cell in self.stored()]

    def report_cells(self) -> list[dict]:
        """Every stored cell, for the report, refused (``ValueError``) when the folder mixes
        comparisons: another scope (model, sizes, evaluation settings), or cells of one task and
        seed made from different data."""
        stored = self.stored()
        if stored:
            first_path, first = stored[0]
            ours = scope(first["key"])
            for path, cell in stored[1:]:
                theirs = scope(cell["key"])
                if theirs != ours:
                    differ = scope_difference(ours, theirs)
                    raise ValueError(
                        f"{self.root} mixes the cells of different comparisons ({differ}: "
                        f"{first_path.relative_to(self.root)} and {path.relative_to(self.root)}); "
                        "a table of them would be wrong: move one comparison's cells to a folder of its own"
                    )
        data: dict[tuple, tuple[Path, dict]] = {}
        for path, cell in stored:
            for part in ("data_sha256", "splits_sha256"):
                value = cell["key"].get(part)
                if value is None:
                    continue
                seen = data.setdefault((cell["task"], cell["seed"], part), (path, value))
                if seen[1] != value:
                    raise ValueError(
                        f"{self.root}: the cells of task {cell['task']} seed {cell['seed']} were made "
                        f"from different data ({seen[0].relative_to(self.root)} and "
                        f"{path.relative_to(self.root)}): rerun `loca compare` on this folder to "
                        "recompute the stale ones"
                    )
        return [cell for _, cell in stored]
