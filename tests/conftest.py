"""Shared fixtures and collection rules. Tests never reach a model hub; ``slow`` tests run only on
request; every test is marked either ``unit`` or ``integration`` (pyproject.toml says which is
which), so ``-m unit`` and ``-m integration`` split the suite in two."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# A hub id must fail at once instead of retrying for ~45 s (docs/models.md).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # allow running the tests from a checkout without installing the package
    import loca  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (real models)")


KINDS = ("unit", "integration")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
    unmarked = [it.nodeid for it in items if sum(it.get_closest_marker(k) is not None for k in KINDS) != 1]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} tests are not marked exactly one of {' or '.join(KINDS)}: {', '.join(unmarked)}"
        )
    markexpr = config.getoption("-m") or ""
    if config.getoption("--run-slow") or os.environ.get("LOCA_RUN_SLOW") == "1":
        return
    if "slow" in markexpr and "not slow" not in markexpr:
        return
    skip = pytest.mark.skip(reason="slow: pass --run-slow (or -m slow) to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct ``(model, tokenizer)`` via its offline alias (slow)."""
    from loca.models.parts import load_model

    return load_model("smollm2-135m-instruct", device="cpu")
