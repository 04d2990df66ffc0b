#!/usr/bin/env bash
# Create .venv at the project root (if missing) and install loca with its test, baseline and plot extras.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# Install torch first with an exact pin: where a CPU wheel of it lies on disk (these machines),
# pip takes it instead of a multi-GB CUDA build; anything later that accepts it installs no other.
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev,hub,baselines,plot]"
