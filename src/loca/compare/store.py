"""Where a comparison keeps its finished cells, and when a stored cell may be reused.

A cell is one method on one task and seed. It is stored as ``cells/<task>/seed<seed>/<method>.json``
holding its full configuration (the *key*: model fingerprint, data and split record, method
configuration, evaluation settings, device type and package versions), its metrics and its
held-out history. A stored cell is reused only when its key equals the key the current run would
write, so an interrupted comparison continues where it stopped and a changed setting recomputes
exactly the cells it affects.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from ..infra.io import atomic_write_json

CELLS = "cells"


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


class CellStore:
    """The cells of one comparison folder."""

    def __init__(self, out: str | Path):
        self.root = Path(out)

    def path(self, task: str, seed: int, method: str) -> Path:
        return self.root / CELLS / task / f"seed{seed}" / f"{method}.json"

    def load(self, task: str, seed: int, method: str, key: dict) -> dict | None:
        """The stored cell if its key equals ``key`` (compared as JSON), else None."""
        path = self.path(task, seed, method)
        if not path.is_file():
            return None
        try:
            cell = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return cell if cell.get("key") == jsonable(key) else None

    def save(self, task: str, seed: int, method: str, key: dict, cell: dict) -> None:
        atomic_write_json(self.path(task, seed, method), jsonable({"key": key, **cell}))

    def all_cells(self) -> list[dict]:
        """Every stored cell (for the report), in a stable order."""
        cells = []
        for path in sorted((self.root / CELLS).glob("*/seed*/*.json")):
            try:
                cells.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return cells
