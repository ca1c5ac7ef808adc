"""Residual-stream diagnostics, every ``log.diagnostics_interval`` steps.

A forward pass (eval mode, no gradients) of a fixed held-out micro-batch, the first of the
validation set (``parallel.pipeline`` of them under the interleaved schedule, which needs
that many), runs through the pipeline schedule while ``probe.recording()`` is on. Forward
pre-hooks on the norms record the RMS of what each layer reads; the designs record their
internals through ``probe.record`` (t2train/residual/, t2train/residual/shortswa.py). Training
math is untouched. Each rank records the layers it holds; tensor rank 0 of data-parallel rank
0 of every pipeline stage sends its records to the logging rank, which writes:

* ``diagnostics/residual_rms/layer_NN`` and ``.../final`` (scalars) and
  ``diagnostics/residual_rms`` (image): RMS of the hidden state each layer's attention norm
  reads (for ``attnres``, the depth mixture), and of the final norm's input;
* ``ddl``: ``diagnostics/ddl_beta/layer_NN.attn|mlp`` and ``diagnostics/ddl_kx/...``
  (histograms): the gate beta in (0, 2) and the readout k^T X per token (and state column);
* ``depth_attn``, ``attnres``, ``block_attnres``: ``diagnostics/depth_attention`` (image),
  the mean attention weight of each reading layer or sublayer (rows) on each depth source
  (columns);
* ``shortswa``: ``diagnostics/shortswa_entropy/layer_NN`` (scalars), the mean attention
  entropy in nats over the last 128 queries (log(window) would be uniform).
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from t2train.monitor import plots
from t2train.nn import probe
from t2train.residual.attnres import SUBLAYERS_PER_LAYER

HISTOGRAM_VALUES = 4096  # at most this many values per histogram are gathered
SUBLAYER_NAMES = ("attn", "mlp")


def _layer(number: int) -> str:
    return f"layer_{number:02d}"


def _sublayer(index: int) -> str:
    """0-based global sublayer index (two per layer) -> ``layer_NN.attn`` / ``.mlp``."""
    layer, position = divmod(index, SUBLAYERS_PER_LAYER)
    return f"{_layer(layer + 1)}.{SUBLAYER_NAMES[position]}"


class Diagnostics:
    def __init__(self, engine, interval: int, micro_batches: list, monitor, sends: bool):
        self.engine = engine
        self.interval = interval
        self.micro_batches = micro_batches
        self.monitor = monitor
        self.sends = sends  # this rank's records reach the logging rank
        self.num_layers = engine.config.model.num_layers

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def log(self, step: int) -> None:
        """Record, gather to the logging rank and write (collective: every rank calls it)."""
        records = self._record()  # every rank runs the forward: it is collective too
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(records if self.sends else {}, gathered, dst=0)
        if dist.get_rank() == 0:
            merged: probe.Records = {}
            for part in gathered:
                for kind, values in part.items():
                    merged.setdefault(kind, {}).update(values)
            self._write(step, merged)

    def _record(self) -> probe.Records:
        hooks = []
        for chunk in self.engine.model:
            decoder = chunk.module.decoder
            for layer in decoder.layers:
                hooks.append(layer.input_layernorm.register_forward_pre_hook(
                    _rms_hook(layer.layer_number)))
            if decoder.post_process:
                hooks.append(decoder.final_layernorm.register_forward_pre_hook(
                    _rms_hook(self.num_layers + 1)))
        try:
            with probe.recording() as records:
                self.engine.evaluate([self.micro_batches])
        finally:
            for hook in hooks:
                hook.remove()
        for kind in ("ddl_beta", "ddl_kx"):
            for key, values in records.get(kind, {}).items():
                flat = values.flatten()
                records[kind][key] = flat[::max(1, flat.numel() // HISTOGRAM_VALUES)]
        return records

    def _write(self, step: int, records: probe.Records) -> None:
        if "residual_rms" in records:
            self._write_rms(step, records["residual_rms"])
        for kind in ("ddl_beta", "ddl_kx"):
            for (layer, position), values in sorted(records.get(kind, {}).items()):
                self.monitor.histogram(
                    step, f"diagnostics/{kind}/{_layer(layer)}.{SUBLAYER_NAMES[position]}", values)
        if "depth_attn" in records:
            self._write_depth_attn(step, records["depth_attn"])
        if "attnres" in records:
            self._write_attnres(step, records["attnres"])
        if "shortswa_entropy" in records:
            self.monitor.scalars(step, {
                f"diagnostics/shortswa_entropy/{_layer(layer)}": float(entropy)
                for layer, entropy in sorted(records["shortswa_entropy"].items())})

    def _write_rms(self, step: int, rms: dict) -> None:
        labels = [_layer(key) if key <= self.num_layers else "final" for key in sorted(rms)]
        values = [float(rms[key]) for key in sorted(rms)]
        self.monitor.scalars(step, {f"diagnostics/residual_rms/{label}": value
                                    for label, value in zip(labels, values)})
        self.monitor.image(step, "diagnostics/residual_rms", plots.line_plot(
            labels, values, f"residual-stream RMS by depth, step {step}", "RMS"))

    def _write_depth_attn(self, step: int, weights: dict) -> None:
        """Layer l reads the states entering layers l-n+1 .. l, i.e. h^(l-n) .. h^(l-1)."""
        matrix = np.full((self.num_layers, self.num_layers), np.nan)
        for layer, row in weights.items():
            matrix[layer - 1, layer - len(row):layer] = row.numpy()
        self._write_heatmap(step, matrix, [_layer(n + 1) for n in range(self.num_layers)],
                            ["h0 (emb)"] + [f"h{i}" for i in range(1, self.num_layers)],
                            "reading layer", "state entering layer i (h_i)")

    def _write_attnres(self, step: int, weights: dict) -> None:
        """Read i (sublayers, then the final norm) mixes sources 0 .. n-1 (0: embedding)."""
        reads = SUBLAYERS_PER_LAYER * self.num_layers + 1
        sources = max(len(row) for row in weights.values())
        matrix = np.full((reads, sources), np.nan)
        for read, row in weights.items():
            matrix[read, :len(row)] = row.numpy()
        rows = [_sublayer(i) for i in range(reads - 1)] + ["final"]
        if self.engine.config.model.residual == "attnres":
            columns = ["emb"] + [_sublayer(i) for i in range(sources - 1)]
        else:
            columns = ["emb"] + [f"block {i}" for i in range(1, sources)]
        self._write_heatmap(step, matrix, rows, columns, "reading sublayer", "source")

    def _write_heatmap(self, step: int, matrix, rows, columns, ylabel, xlabel) -> None:
        residual = self.engine.config.model.residual
        self.monitor.image(step, "diagnostics/depth_attention", plots.heatmap(
            matrix, rows, columns, f"{residual}: mean attention over depth, step {step}",
            xlabel, ylabel))


def _rms_hook(key: int):
    def hook(_module, args):
        probe.record("residual_rms", key, lambda: args[0].float().pow(2).mean().sqrt())

    return hook


def diagnostic_micro_batches(val_batches: list, config) -> list:
    """The held-out micro-batches of the diagnostics pass (see the module docstring)."""
    count = config.parallel.pipeline if config.parallel.virtual_pipeline > 1 else 1
    return val_batches[0][:count]
