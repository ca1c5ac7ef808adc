"""Render a run's TensorBoard event data as one PNG (the figure in README.md, "Monitoring").

    python docs/render_run_figure.py runs/NAME/tensorboard docs/monitoring-example.png

Reads the event files with TensorBoard's own reader and draws a few scalar panels plus the
latest diagnostic images, as TensorBoard would show them; it is a plot of the logged data,
not a screenshot of the TensorBoard web page.
"""

from __future__ import annotations

import io
import sys

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PANELS = [  # (title, tags)
    ("loss", ["train/loss", "val/loss"]),
    ("throughput/tokens_per_sec", ["throughput/tokens_per_sec"]),
    ("norms", ["train/grad_norm", "train/param_norm"]),
    ("time per step (s)", ["time/step_seconds", "time/data_wait_seconds"]),
]
IMAGES = ["diagnostics/residual_rms", "diagnostics/depth_attention"]


def render(event_dir: str, out: str) -> None:
    events = EventAccumulator(event_dir, size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    images = [tag for tag in IMAGES if tag in tags["images"]]
    figure = Figure(figsize=(16, 8), dpi=100)
    grid = figure.add_gridspec(2, 4)
    for index, (title, panel_tags) in enumerate(PANELS):
        axes = figure.add_subplot(grid[index // 2, index % 2])
        for tag in panel_tags:
            points = events.Scalars(tag)
            axes.plot(
                [p.step for p in points],
                [p.value for p in points],
                label=tag,
                marker="." if len(points) < 30 else None,
            )
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("step", fontsize=8)
        axes.legend(fontsize=8)
        axes.grid(alpha=0.3)
    for index, tag in enumerate(images):
        axes = figure.add_subplot(grid[index, 2:])
        latest = events.Images(tag)[-1]
        axes.imshow(np.asarray(Image.open(io.BytesIO(latest.encoded_image_string))))
        axes.set_title(f"{tag} (image, step {latest.step})", fontsize=10)
        axes.axis("off")
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(out)


if __name__ == "__main__":
    render(*sys.argv[1:3])
