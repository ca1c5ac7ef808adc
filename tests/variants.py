"""Which residual variants an expensive test family runs: one rule, read from the designs'
declarations, so that a new design is picked up without editing any test.

A test that checks every design along one path (a parallel layout, a resume, an export, a
compile depth) multiplies with every design added; most of what such a test can catch
depends on the *kind* of stream state a design carries, not on the design:

* ``depth cache``: units that never change once made (earlier layer states, AttnRes
  sources): what the pipeline's depth cache keeps and the hops send once;
* ``streams``: several units that all change at every sublayer (HC's and mHC's n streams,
  DDL's d_v columns): wider hops, wider checkpoints;
* ``plain``: one changing unit, as `standard`.

``spread(paths)`` gives every path one design of each kind (rotating through each kind's
designs), the local mixer on one of them (rotating through the kinds), and every design at
least once over all the paths: pairwise coverage instead of the full product. A family with
one path runs every design (``every_design``). Each design's math, kernels and one
end-to-end test of each kind of path run for every design regardless (docs/testing.md).
"""

from __future__ import annotations

from functools import cache

from t2train.config.loader import load_config
from t2train.residual import get_design, mixer, registered

KINDS = ("depth cache", "streams", "plain")
PROBE_LAYERS = 8  # deep enough for every design's state to show how it grows


@cache
def _unit_ids(design: str) -> tuple[tuple, ...]:
    model = load_config(
        overrides=[
            "data.path=unused",
            f"model.num_layers={PROBE_LAYERS}",
            f"model.residual={design}",
        ]
    ).model
    return tuple(
        tuple(get_design(design).unit_ids(model, done)) for done in range(PROBE_LAYERS + 1)
    )


def kind(design: str) -> str:
    """The kind of stream state ``design`` carries, at its default options."""
    states = _unit_ids(design)
    if any(unit is not None for state in states for unit in state):
        return "depth cache"
    return "streams" if max(len(state) for state in states) > 1 else "plain"


def depth_dependent(design: str) -> bool:
    """Whether the state's structure changes with the number of layers done (so compiled
    layers could differ with depth): its unit count is not the same after every layer."""
    return len({len(state) for state in _unit_ids(design)}) > 1


def with_mixer(design: str) -> str:
    return f"{design}+{mixer().name}"


def spread(paths: list[str], designs: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """path -> the variants (``design`` or ``design+shortswa``) it runs, by the rule above.
    With ``designs``, among those only (in registry order otherwise)."""
    designs = designs or registered()
    members = {k: [d for d in designs if kind(d) == k] for k in KINDS}
    kinds = [k for k in KINDS if members[k]]
    chosen: dict[str, list[str]] = {}
    for index, path in enumerate(paths):
        picks = [members[k][index % len(members[k])] for k in kinds]
        mixed = index % len(picks)
        chosen[path] = [with_mixer(d) if i == mixed else d for i, d in enumerate(picks)]
    covered = {v.partition("+")[0] for variants in chosen.values() for v in variants}
    for design in (d for d in designs if d not in covered):  # too few paths for a kind
        path = min(paths, key=lambda p: len(chosen[p]))
        chosen[path].append(design)
    return chosen


def every_design() -> list[str]:
    """Each design once, the mixer on one design of each kind: a family with one path."""
    seen_kinds: set[str] = set()
    variants = []
    for design in registered():
        first_of_kind = kind(design) not in seen_kinds
        seen_kinds.add(kind(design))
        variants.append(with_mixer(design) if first_of_kind else design)
    return variants
