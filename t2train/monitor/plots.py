"""Diagnostic pictures as RGB arrays for TensorBoard's image panel (matplotlib, off-screen)."""

from __future__ import annotations

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _pixels(figure: Figure) -> np.ndarray:
    """[height, width, 3] uint8."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def line_plot(labels: list[str], values: list[float], title: str, ylabel: str) -> np.ndarray:
    figure = Figure(figsize=(min(max(4.0, 0.35 * len(labels) + 2), 16), 3.2), dpi=100)
    axes = figure.add_subplot()
    axes.plot(range(len(values)), values, marker="o")
    axes.set_xticks(range(len(labels)), labels, rotation=90 if len(labels) > 12 else 0, fontsize=7)
    axes.set_title(title, fontsize=9)
    axes.set_ylabel(ylabel, fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    return _pixels(figure)


def heatmap(
    matrix: np.ndarray,
    row_labels: list[str],
    column_labels: list[str],
    title: str,
    xlabel: str,
    ylabel: str,
) -> np.ndarray:
    """Rows x columns in [0, 1]; NaN cells (no such source) are left blank."""
    rows, columns = matrix.shape
    size = (min(max(5.0, 2.5 + 0.3 * columns), 14), min(max(3.0, 1.5 + 0.25 * rows), 12))
    figure = Figure(figsize=size, dpi=100)
    axes = figure.add_subplot()
    image = axes.imshow(
        np.ma.masked_invalid(matrix),
        vmin=0.0,
        vmax=1.0,
        cmap="viridis",
        aspect="auto",
        interpolation="nearest",
    )
    axes.set_xticks(range(columns), column_labels, rotation=90, fontsize=6)
    axes.set_yticks(range(rows), row_labels, fontsize=6)
    axes.set_title(title, fontsize=9)
    axes.set_xlabel(xlabel, fontsize=8)
    axes.set_ylabel(ylabel, fontsize=8)
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    return _pixels(figure)
