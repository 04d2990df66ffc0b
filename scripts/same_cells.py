"""Check that two `loca compare` folders hold the same cells: every value of every cell equal,
except wall times, memory and recorded versions (which differ run to run).

    python scripts/same_cells.py BEFORE_DIR AFTER_DIR

Exit status 1 if a cell is missing or differs. Used to check that a refactoring changed no result
(docs/architecture.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SKIP = {"versions", "peak_memory_mb", "memory_kind", "distributed"}  # keys whose values differ run to run


def flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {
            k: v
            for key, val in obj.items()
            if key not in SKIP
            for k, v in flat(val, f"{prefix}{key}.").items()
        }
    if isinstance(obj, list):
        return {k: v for i, val in enumerate(obj) for k, v in flat(val, f"{prefix}{i}.").items()}
    return {prefix[:-1]: obj}


def timing(key: str) -> bool:
    """A wall time (a key ending in ``_s``, or an entry of a dict of them)."""
    return any(part.endswith("_s") for part in key.split("."))


def main(before: Path, after: Path) -> int:
    bad = 0
    for fa in sorted((before / "cells").rglob("*.json")):
        rel = fa.relative_to(before)
        fb = after / rel
        if not fb.is_file():
            print(f"{rel}: missing in {after}")
            bad += 1
            continue
        a, b = flat(json.loads(fa.read_text())), flat(json.loads(fb.read_text()))
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not timing(k)]
        bad += bool(diff)
        print(
            f"{rel}: "
            + (f"{len(diff)} values differ, e.g. {diff[:5]}" if diff else f"identical ({len(a)} values)")
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
