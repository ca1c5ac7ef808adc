"""The fewest residual-state units each pipeline hop must carry, from each design's definition.

Written from the papers' formulas (docs/residuals.md), not from the streams' ``unit_ids`` or
``HopPlan``: after ``b`` layers, the layers still to run and the final read need certain
earlier tensors; a tensor that never changes once made can be reused by a rank that already
held it (received or produced in an earlier chunk of the same micro-batch); the hop must
carry everything else.
"""

from __future__ import annotations


def _sublayers_per_layer(model) -> int:
    return 3 if model.shortswa.window > 0 else 2  # the local mixer adds a sublayer


def live_tensors(model, layers_done: int) -> list[tuple[object, bool]]:
    """(name, never changes) of every tensor the rest of the model reads after ``layers_done``
    layers."""
    n = _sublayers_per_layer(model) * layers_done  # sublayers done
    if model.residual == "attnres":
        # Sublayer j and the final read mix the embedding and every sublayer output before them.
        return [("embedding", True)] + [(("output", j), True) for j in range(n)]
    if model.residual == "block_attnres":
        # Reads mix the embedding, the completed block sums and the open block's partial sum,
        # which the next sublayer's output changes.
        s = model.attnres.block_size
        done = [("embedding", True)] + [(("block", k), True) for k in range(n // s)]
        return done + ([(("partial", n), False)] if n % s else [])
    if model.residual == "depth_attn":
        # Layer l reads the states entering layers l-K+1 .. l; the next one is layers_done.
        k = model.depth_attn.window
        return [(("state", i), True) for i in range(max(0, layers_done - k + 1), layers_done + 1)]
    if model.residual == "ddl":
        # d_v columns of the state, each rewritten by every sublayer.
        return [(("column", j, layers_done), False) for j in range(model.ddl.dv)]
    assert model.residual == "standard", model.residual
    return [(("state", layers_done), False)]  # the running sum


def minimum_hop_units(model, pipeline: int, virtual: int, cached: bool) -> list[int]:
    """Units the hops into chunks 1 .. P*V-1 must carry (``cached=False``: the receiver is
    assumed to hold nothing, i.e. everything the rest of the model reads)."""
    chunks = pipeline * virtual
    per_chunk = model.num_layers // chunks
    units = []
    for chunk in range(1, chunks):
        held = set()
        for earlier in range(chunk - pipeline, -1, -pipeline) if cached else ():
            for boundary in (earlier * per_chunk, (earlier + 1) * per_chunk):
                held |= {name for name, fixed in live_tensors(model, boundary) if fixed}
        units.append(sum(name not in held for name, _ in live_tensors(model, chunk * per_chunk)))
    return units
