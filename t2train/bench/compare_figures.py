"""The figures of ``t2train experiment compare``: validation loss against training tokens
and against training FLOPs, one colour per variant, the mean over seeds as a line and their
min-max as a band.

Each figure has two panels: the whole run on a log x-axis (the first evaluation after step 0
onwards), and the second half of training on a linear one with the y-axis fitted to it, where
the variants' differences are visible. The legend sits outside both, on the right.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from t2train.bench.compare_report import VariantRuns

SIZE_INCHES, DPI = (12.0, 5.0), 100  # 1200 x 500 pixels
TOKENS_FIGURE, FLOPS_FIGURE = "val_loss_vs_tokens.png", "val_loss_vs_flops.png"


def write_figures(results: list[VariantRuns], budget: float, out: Path) -> list[str]:
    """Both PNGs in ``out``; returns their file names. ``budget``: the equal-FLOPs budget,
    marked in the FLOPs figure."""
    _figure(
        results, lambda r, s: s * r.tokens_per_step, "training tokens", None, out / TOKENS_FIGURE
    )
    _figure(
        results,
        lambda r, s: r.flops_at(s),
        "training FLOPs (forward + backward)",
        budget,
        out / FLOPS_FIGURE,
    )
    return [TOKENS_FIGURE, FLOPS_FIGURE]


def _figure(results: list[VariantRuns], x_of, xlabel: str, budget, path: Path) -> None:
    figure = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained")
    whole, late = figure.subplots(1, 2)
    colours = _colours(len(results))
    late_losses = []
    for result, colour in zip(results, colours, strict=True):
        steps = [step for step in result.steps() if step > 0]
        x = np.array([x_of(result, step) for step in steps], dtype=float)
        losses = np.array([[curve[step] for step in steps] for curve in result.curves])
        mean, low, high = losses.mean(axis=0), losses.min(axis=0), losses.max(axis=0)
        second_half = np.array(steps) >= result.final_step() / 2
        for axes, keep in ((whole, slice(None)), (late, second_half)):
            axes.plot(x[keep], mean[keep], color=colour, label=result.variant, marker=".")
            axes.fill_between(x[keep], low[keep], high[keep], color=colour, alpha=0.2, linewidth=0)
        late_losses += [low[second_half], high[second_half]]
    whole.set_xscale("log")
    whole.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap
    whole.set_title("whole run (log scale)", fontsize=10)
    late.set_title("second half of training", fontsize=10)
    values = np.concatenate(late_losses)
    values = values[np.isfinite(values)]
    if values.size:
        margin = max(0.05 * (values.max() - values.min()), 1e-3)
        late.set_ylim(values.min() - margin, values.max() + margin)
    for axes in (whole, late):
        if budget is not None:
            axes.axvline(
                budget,
                color="0.3",
                linestyle="--",
                linewidth=1,
                label="equal-FLOPs budget" if axes is whole else None,
            )
        axes.set_xlabel(xlabel)
        axes.set_ylabel("validation loss (mean over seeds, band: min-max)")
        axes.grid(alpha=0.3, which="both")
    figure.legend(*whole.get_legend_handles_labels(), loc="outside right upper", fontsize=9)
    figure.savefig(path, dpi=DPI)


def _colours(count: int) -> list:
    """Distinct colours: matplotlib's tab10, or tab20 past ten variants."""
    from matplotlib import colormaps

    palette = colormaps["tab10" if count <= 10 else "tab20"]
    return [palette(index % palette.N) for index in range(count)]
