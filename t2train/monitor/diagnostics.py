"""Residual-stream diagnostics, every ``log.diagnostics_interval`` steps.

A forward pass (eval mode, no gradients) of a fixed held-out micro-batch, the first of the
validation set (``parallel.pipeline`` of them under the interleaved schedule, which needs
that many), runs through the pipeline schedule while ``probe.recording()`` is on. Forward
pre-hooks on the norms record the RMS of what each layer reads; the residual design and the
local mixer record their internals through ``probe.record`` (``t2train/residual/``).
Training math is untouched. Each rank records the layers it holds; tensor rank 0 of
data-parallel rank 0 of every pipeline stage sends its records to the logging rank, which
writes ``diagnostics/residual_rms/layer_NN`` and ``.../final`` (scalars) and
``diagnostics/residual_rms`` (image): the RMS of the hidden state each layer's attention norm
reads (for AttnRes, the depth mixture) and of the final norm's input; then hands the records
to the design's and the mixer's ``write_diagnostics`` (their docstrings list their tags).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from t2train.nn import probe
from t2train.residual import components

HISTOGRAM_VALUES = 4096  # at most this many values of a record are gathered


def _layer(number: int) -> str:
    return f"layer_{number:02d}"


class Diagnostics:
    def __init__(self, engine, interval: int, micro_batches: list, monitor, sends: bool):
        self.engine = engine
        self.interval = interval
        self.micro_batches = micro_batches
        self.monitor = monitor
        self.sends = sends  # this rank's records reach the logging rank
        self.model = engine.config.model
        self.num_layers = self.model.num_layers

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def log(self, step: int) -> None:
        """Record, gather to the logging rank and write (collective: every rank calls it)."""
        records = self._record()  # every rank runs the forward: it is collective too
        gathered: Optional[list[probe.Records]] = (
            [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
        )
        dist.gather_object(records if self.sends else {}, gathered, dst=0)
        if gathered is not None:
            merged: probe.Records = {}
            for part in gathered:
                for kind, values in part.items():
                    merged.setdefault(kind, {}).update(values)
            self._write(step, merged)

    def _record(self) -> probe.Records:
        hooks = []
        for chunk in self.engine.model:
            for number, norm in chunk.module.stream_norms():
                hooks.append(norm.register_forward_pre_hook(_rms_hook(number)))
        try:
            with probe.recording() as records:
                self.engine.evaluate([self.micro_batches])
        finally:
            for hook in hooks:
                hook.remove()
        for values in records.values():  # per-token records are subsampled before gathering
            for key, value in values.items():
                flat = value.flatten()
                if flat.numel() > HISTOGRAM_VALUES:
                    values[key] = flat[:: flat.numel() // HISTOGRAM_VALUES]
        return records

    def _write(self, step: int, records: probe.Records) -> None:
        if "residual_rms" in records:
            self._write_rms(step, records["residual_rms"])
        for part in components(self.model):
            part.write_diagnostics(self, step, records, self.model)

    # --- what a design's writer may call (t2train.residual.base.DiagnosticsWriter) ---------
    def scalars(self, step: int, values: dict) -> None:
        self.monitor.scalars(step, values)

    def histogram(self, step: int, tag: str, values) -> None:
        self.monitor.histogram(step, tag, values)

    def heatmap(
        self,
        step: int,
        tag: str,
        matrix,
        rows: list,
        columns: list,
        title: str,
        xlabel: str,
        ylabel: str,
    ) -> None:
        self.monitor.image(
            step, tag, _plots().heatmap(matrix, rows, columns, title, xlabel, ylabel)
        )

    def _write_rms(self, step: int, rms: dict) -> None:
        labels = [_layer(key) if key <= self.num_layers else "final" for key in sorted(rms)]
        values = [float(rms[key]) for key in sorted(rms)]
        self.monitor.scalars(
            step,
            {f"diagnostics/residual_rms/{label}": value for label, value in zip(labels, values)},
        )
        self.monitor.image(
            step,
            "diagnostics/residual_rms",
            _plots().line_plot(labels, values, f"residual-stream RMS by depth, step {step}", "RMS"),
        )


def _plots():
    """t2train.monitor.plots, imported at the first picture: matplotlib is 0.55 s of every
    trainer's start, and most processes draw none."""
    from t2train.monitor import plots  # noqa: PLC0415 - matplotlib: 0.55 s of a start, at the first picture

    return plots


def _rms_hook(key: int):
    def hook(_module, args):
        probe.record("residual_rms", key, lambda: args[0].float().pow(2).mean().sqrt())

    return hook


def diagnostic_micro_batches(val_batches: list, config) -> list:
    """The held-out micro-batches of the diagnostics pass (see the module docstring)."""
    count = config.parallel.pipeline if config.parallel.virtual_pipeline > 1 else 1
    return val_batches[0][:count]
