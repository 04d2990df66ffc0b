"""Versions recorded with every artefact, for reproducibility."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("loca", "torch", "transformers", "safetensors", "peft"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out
