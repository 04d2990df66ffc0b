"""Shared fixtures. Tests never reach a model hub; ``slow`` tests run only on request."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# A hub id must fail at once instead of retrying for ~45 s (docs/models.md).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # allow running the tests from a checkout without installing the package
    import loca  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", help="also run tests marked slow (real models)"
    )


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("-m") or ""
    if config.getoption("--run-slow") or os.environ.get("LOCA_RUN_SLOW") == "1":
        return
    if "slow" in markexpr and "not slow" not in markexpr:
        return
    skip = pytest.mark.skip(reason="slow: pass --run-slow (or -m slow) to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


@pytest.fixture
def tiny_llama():
    """A randomly initialised 2-block Llama (d=32, V=101) in float32, eval mode, seed 0."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct ``(model, tokenizer)`` via its offline alias (slow)."""
    from loca.models.parts import load_model

    return load_model("smollm2-135m-instruct", device="cpu")
