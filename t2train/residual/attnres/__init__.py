"""`attnres` and `block_attnres`: Attention Residuals (Kimi Team, arXiv 2603.15031).

Every sublayer (attention and MLP each count as a layer l) reads its input as a softmax
mixture over depth sources instead of the running sum:

    h_l = sum_i alpha_{i->l} v_i,  alpha_{i->l} = softmax_i(w_l . RMSNorm(v_i))

with w_l a learned pseudo-query, zero-initialised (uniform weights at the start), RMSNorm
weight-free and on the keys only, no temperature. The sublayer output f_l(Norm(h_l)) becomes
a new source.

* `attnres` (Full): sources are the embedding v_0 and every earlier sublayer output.
* `block_attnres` (Block): sublayer outputs are summed within blocks of S sublayers
  (``model.attnres.block_size``); sources are the embedding, the completed block sums and
  the current block's partial sum. S = 1 is Full.

With the local mixer on, its ShortSWA sublayer is a sublayer like attention and the MLP: it
reads a mixture and its output is a source (three sublayers per layer instead of two).

The final norm reads a last mixture with its own pseudo-query. The stream state is
``AttnResState(sources, partial)``; a pipeline hop carries all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from t2train.errors import require
from t2train.residual.declaration import BODY, ResidualDesign, SavedPerToken, Traffic
from t2train.residual.sublayers import mixer, mixer_on, sublayer_names


@dataclass
class AttnResOptions:
    """``model.attnres`` (both AttnRes designs): softmax mixing over earlier sublayer outputs."""

    block_size: int = 4  # `block_attnres`: sublayers per block (every sublayer counts)
    eps: float = 1e-6  # of the weight-free RMSNorm on keys

    def validate(self, prefix: str) -> None:
        require(self.block_size >= 1, f"{prefix}.block_size", self.block_size, "must be >= 1")
        require(self.eps > 0, f"{prefix}.eps", self.eps, "must be > 0")


def sublayers_per_layer(model) -> int:
    return len(sublayer_names(model))


def check_blocks(config) -> None:
    """Blocks tile the sublayers exactly (the last one closes at the final read)."""
    model = config.model
    per_layer = sublayers_per_layer(model)
    mixing = (
        f"; model.{mixer().section}.window={getattr(model, mixer().section).window} adds "
        "a sublayer per layer"
        if mixer_on(model)
        else ""
    )
    require(
        (per_layer * model.num_layers) % model.attnres.block_size == 0,
        "model.attnres.block_size",
        model.attnres.block_size,
        f"must divide the number of sublayers {per_layer} x model.num_layers = "
        f"{per_layer * model.num_layers} ({', '.join(sublayer_names(model))} per layer"
        f"{mixing})",
    )


def _source_counts(model, block_size: int) -> list[int]:
    """Sources each sublayer reads, and the final read last."""
    counts = []
    for index in range(sublayers_per_layer(model) * model.num_layers + 1):
        counts.append(len(source_unit_ids(index, block_size)))
    return counts


def completed_sources(sublayers: int, block_size: int) -> int:
    """The embedding and the blocks completed after ``sublayers`` sublayers."""
    return 1 + sublayers // block_size


def source_unit_ids(sublayers: int, block_size: int) -> list:
    """Sources 0 .. n-1 (embedding, completed blocks) and None for an open block's partial,
    after ``sublayers`` sublayers."""
    sources = list(range(completed_sources(sublayers, block_size)))
    return sources + ([None] if sublayers % block_size else [])


def one_sublayer(_model) -> int:
    """`attnres`: every sublayer output is a source (blocks of one)."""
    return 1


def configured_block(model) -> int:
    return model.attnres.block_size


def unit_ids_for(block_size_of):
    def unit_ids(model, layers_done: int) -> list:
        return source_unit_ids(sublayers_per_layer(model) * layers_done, block_size_of(model))

    return unit_ids


def extra_parameters(model) -> int:
    reads = sublayers_per_layer(model) * model.num_layers + 1  # and the final norm's
    return reads * model.hidden_size  # one pseudo-query per read


def extra_flops_for(block_size_of):
    def extra_flops_per_token(model) -> int:
        """Per read and source: RMS (2h), score (2h), weighted sum (2h)."""
        return sum(6 * model.hidden_size * n for n in _source_counts(model, block_size_of(model)))

    return extra_flops_per_token


def traffic_for(block_size_of):
    def minimum_traffic(model, layer: int) -> Traffic:
        """Averaged over the layer's sublayers; blocks of B sublayers (Full: B = 1), N the
        completed sources a sublayer reads (the embedding, the blocks closed before it).
        Full: the read reads the N sources and writes the normed input (N + 1; the output
        itself is the new source); backward, the normed input's gradient read, the sources
        read and each source's gradient added into (1 + 3N). Block, two phases: the N
        completed sources are read once per block for its B reads (N / B per read), each
        read's phase-1 result written and read again (2), the normed input written (1), an
        open block's partial sum read by the read and updated by the write (read twice, the
        output read, the sum written: 4); backward, the normed input's gradient (1), phase
        2's result read and its gradient written (2, and the partial's 2 when open), phase
        1 per block reading the results' gradients and the sources and adding into the
        sources' gradients ((B + 3N) / B)."""
        block, per_layer = block_size_of(model), sublayers_per_layer(model)
        forward = backward = 0.0
        for index in range(per_layer * layer, per_layer * (layer + 1)):
            completed, open_block = completed_sources(index, block), index % block != 0
            if block == 1:
                forward += BODY.forward + completed + 1
                backward += BODY.backward + 1 + 3 * completed
            else:
                forward += BODY.forward + completed / block + 3 + 4 * open_block
                backward += BODY.backward + 3 + 2 * open_block + (block + 3 * completed) / block
        return Traffic(forward / per_layer, backward / per_layer)

    return minimum_traffic


def saved_for(block_size_of, two_phase: bool):
    def saved_per_token(model) -> SavedPerToken:
        """The chunk's buffer of completed sources (one unit each), a source read by a later
        sublayer of the layer that made it (kept once more, as the read's input), the open
        block's partial sum at each read that merges it, and per read the fp32 statistic of
        its softmax; Block's reads that merge a partial sum (two phases) also keep phase 1's
        result, in the sources' dtype (a block's first read returns it as the norm's input,
        which `standard`'s count has)."""
        per_layer, layers = sublayers_per_layer(model), model.num_layers
        block = block_size_of(model)
        reads = per_layer * layers  # every sublayer's (the final read is one more)
        closing = [k * block for k in range(1, reads // block + 1)]  # sublayers closing a block
        mid_layer = sum(index % per_layer != 0 for index in closing)
        partials = reads - len(closing)
        units = completed_sources(reads, block) + mid_layer + partials
        if two_phase:
            units += partials
        h = model.hidden_size
        return SavedPerToken(whole=units * h / layers, whole_fp32=(reads + 1) / layers)

    return saved_per_token


def diagnostics_for(source_names):
    def write_diagnostics(writer, step: int, records: dict, model) -> None:
        """``diagnostics/depth_attention``: the mean weight of each read (every sublayer, then
        the final norm; rows) on each source (columns; 0 is the embedding)."""
        if "attnres" not in records:
            return
        weights = records["attnres"]
        names = sublayer_names(model)
        sublayer = [
            f"layer_{i // len(names) + 1:02d}.{names[i % len(names)]}"
            for i in range(len(names) * model.num_layers)
        ]
        sources = max(len(row) for row in weights.values())
        matrix = np.full((len(sublayer) + 1, sources), np.nan)
        for read, row in weights.items():
            matrix[read, : len(row)] = row.numpy()
        writer.heatmap(
            step,
            "diagnostics/depth_attention",
            matrix,
            sublayer + ["final"],
            ["emb"] + source_names(sublayer, sources - 1),
            f"{model.residual}: mean attention over depth, step {step}",
            "source",
            "reading sublayer",
        )

    return write_diagnostics


def selective_full(model) -> SavedPerToken:
    """Under selective recompute, Full AttnRes' sources are the layers' inputs (each once,
    the planner's count); the reads inside a layer are recomputed and only the final read,
    outside the layers, keeps the fp32 statistic of its softmax (per token, averaged over
    the layers)."""
    return SavedPerToken(whole_fp32=1 / model.num_layers)


FULL = ResidualDesign(
    name="attnres",
    layers="t2train.residual.attnres.layers",
    stream="FullAttnResStream",
    sublayer="FullAttnResidual",
    reference="Attention Residuals (Full), Kimi Team, arXiv 2603.15031",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_for(one_sublayer),
    saved_per_token=saved_for(one_sublayer, two_phase=False),
    selective_saved_per_token=selective_full,
    minimum_traffic=traffic_for(one_sublayer),
    unit_ids=unit_ids_for(one_sublayer),
    section="attnres",
    options=AttnResOptions,
    write_diagnostics=diagnostics_for(lambda sublayers, count: sublayers[:count]),
)

BLOCK = ResidualDesign(
    name="block_attnres",
    layers="t2train.residual.attnres.layers",
    stream="AttnResStream",
    sublayer="BlockAttnResidual",
    reference="Attention Residuals (Block), Kimi Team, arXiv 2603.15031",
    extra_parameters=extra_parameters,
    extra_flops_per_token=extra_flops_for(configured_block),
    saved_per_token=saved_for(configured_block, two_phase=True),
    minimum_traffic=traffic_for(configured_block),
    unit_ids=unit_ids_for(configured_block),
    section="attnres",
    options=AttnResOptions,
    check=check_blocks,
    write_diagnostics=diagnostics_for(
        lambda sublayers, count: [f"block {i}" for i in range(1, count + 1)]
    ),
)
