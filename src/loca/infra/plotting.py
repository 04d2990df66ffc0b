"""Matplotlib set-up shared by the reports (``loca report``, ``loca compare``): the Agg backend
(no display needed) and a grid of panels."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def panel_grid(n: int):
    """A figure with ``n`` visible panels, at most three a row: ``(figure, [axes])``."""
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])
