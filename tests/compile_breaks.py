"""Graph breaks as dynamo counts them. ``counters["graph_break"]`` misses a break on a guard
it cannot evaluate (a data-dependent size, such as ``torch.logsumexp`` asking whether a
dynamic-size tensor is empty): dynamo splits the graph there all the same and counts the
function it resumes in. A check of "no graph break" reads both."""

from __future__ import annotations


def graph_breaks(counters) -> dict:
    """Each counted graph break and each resume after one (a break by another route)."""
    resumes = {f"resumed in {name}": count for name, count in counters["resumes"].items()}
    return {**counters["graph_break"], **resumes}
