"""What ``t2train experiment compare`` reports: validation loss per variant over seeds, at
equal tokens and at equal training FLOPs, and each variant's difference from the baseline.

Every run of a batch trains the same steps on the same tokens per step, so "equal tokens" is
the final evaluation. Variants differ in training FLOPs per token, so "equal FLOPs" is the
largest budget every variant reached (the cheapest variant's whole run); each run's loss
there is interpolated linearly in FLOPs between its two evaluations around it. A last
section shows the late evaluations with each variant's rank, so a reader can judge whether
the curves (and the ranking) had settled when the batch stopped.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional

import numpy as np

from t2train.bench.table import markdown_table


@dataclass
class VariantRuns:
    variant: str
    curves: list[dict[int, float]]  # one per seed: step -> validation loss
    tokens_per_step: int
    train_flops_per_token: float  # forward + backward (t2train/model/flops.py)
    params: int

    def final_step(self) -> int:
        return min(max(curve) for curve in self.curves)

    def steps(self) -> list[int]:
        """The steps every seed evaluated at."""
        return sorted(set.intersection(*(set(curve) for curve in self.curves)))

    def flops_at(self, step: float) -> float:
        return step * self.tokens_per_step * self.train_flops_per_token

    def final_losses(self) -> list[float]:
        return [curve[self.final_step()] for curve in self.curves]

    def losses_at_flops(self, budget: float) -> list[float]:
        """Each seed's validation loss at ``budget`` training FLOPs (linear in FLOPs between
        evaluations); the budget must be within the run."""
        steps = self.steps()
        if not 0 <= budget <= self.flops_at(steps[-1]) * (1 + 1e-12):
            raise ValueError(f"{self.variant}: {budget:.3e} FLOPs is outside its runs")
        flops = [self.flops_at(step) for step in steps]
        return [
            float(np.interp(budget, flops, [curve[step] for step in steps]))
            for curve in self.curves
        ]


@dataclass
class Spread:
    """Mean, sample standard deviation and range of one number over seeds."""

    values: list[float]

    @property
    def mean(self) -> float:
        return statistics.mean(self.values)

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    def cells(self) -> list[str]:
        return [
            f"{self.mean:.4f}",
            f"{self.std:.4f}",
            f"{min(self.values):.4f}-{max(self.values):.4f}",
        ]


def standard_error_of_difference(a: Spread, b: Spread) -> Optional[float]:
    """sqrt(s_a^2/n_a + s_b^2/n_b); None without two seeds on each side."""
    if len(a.values) < 2 or len(b.values) < 2:
        return None
    return math.sqrt(a.std**2 / len(a.values) + b.std**2 / len(b.values))


def versus(spread: Spread, baseline: Optional[Spread], is_baseline: bool) -> str:
    """The difference of means from the baseline, its standard error, ``*`` past 2 SE."""
    if is_baseline:
        return "(baseline)"
    if baseline is None:
        return "n/a"
    difference = spread.mean - baseline.mean
    error = standard_error_of_difference(spread, baseline)
    if error is None:
        return f"{difference:+.4f} (SE n/a)"
    mark = " *" if abs(difference) > 2 * error else ""
    return f"{difference:+.4f} (SE {error:.4f}){mark}"


def equal_flops_budget(results: list[VariantRuns]) -> float:
    """The largest training-FLOP budget every variant's runs reached."""
    return min(result.flops_at(result.final_step()) for result in results)


def format_report(
    results: list[VariantRuns], baseline: str, context: list[str], figures: list[str]
) -> str:
    """``compare.md``: ``context`` (bullet lines on how it was measured), the two tables, the
    note on the differences and the figures (file names beside the report)."""
    base = next((result for result in results if result.variant == baseline), None)
    vs = f"vs {baseline}"
    tokens = results[0].final_step() * results[0].tokens_per_step  # the same for every run

    def compared(spreads: list[Spread]) -> list[str]:
        base_spread = spreads[results.index(base)] if base else None
        return [
            versus(spread, base_spread, result is base)
            for spread, result in zip(spreads, results, strict=True)
        ]

    finals = [Spread(result.final_losses()) for result in results]
    token_rows = [
        [
            result.variant,
            str(len(result.curves)),
            f"{result.params / 1e6:.2f}",
            f"{result.train_flops_per_token:.3e}",
            f"{result.flops_at(result.final_step()):.3e}",
            *spread.cells(),
            versus_cell,
        ]
        for result, spread, versus_cell in zip(results, finals, compared(finals), strict=True)
    ]
    budget = equal_flops_budget(results)
    at_budget = [Spread(result.losses_at_flops(budget)) for result in results]
    flop_rows = [
        [
            result.variant,
            f"{budget / result.train_flops_per_token:.4g}",
            f"{budget / result.train_flops_per_token / result.tokens_per_step:.1f}",
            *spread.cells(),
            versus_cell,
        ]
        for result, spread, versus_cell in zip(results, at_budget, compared(at_budget), strict=True)
    ]
    lines = [
        "# Validation loss per variant",
        "",
        *(f"- {line}" for line in context),
        "",
        f"## At equal tokens: {tokens} tokens per run",
        "",
        "The final evaluation of each run.",
        "",
        markdown_table(
            [
                "variant",
                "seeds",
                "params (M)",
                "train FLOPs/token",
                "train FLOPs per run",
                "mean val loss",
                "std",
                "min-max",
                vs,
            ],
            token_rows,
        ),
        "",
        f"## At equal training FLOPs: {budget:.3e}",
        "",
        "The largest training-FLOP budget every variant reached; each run's validation "
        "loss there is interpolated linearly in FLOPs between its evaluations.",
        "",
        markdown_table(
            [
                "variant",
                "tokens at budget",
                "steps at budget",
                "mean val loss",
                "std",
                "min-max",
                vs,
            ],
            flop_rows,
        ),
        "",
        _difference_note(baseline, base is not None),
        "",
        *_late_curves(results, base),
    ]
    lines += [f"![{name}]({name})" for name in figures]
    return "\n".join(lines) + "\n"


def late_steps(result: VariantRuns) -> list[int]:
    """The evaluated steps nearest half and three quarters of the run, the one before the
    last, and the last: where a reader sees whether the curves have settled."""
    steps = result.steps()
    final = steps[-1]

    def nearest(fraction: float) -> int:
        return min(steps, key=lambda step: abs(step - fraction * final))

    return sorted({nearest(0.5), nearest(0.75), *steps[-2:]})


def ranks(means: list[float]) -> list[int]:
    """1 for the lowest mean, 2 for the next, ..."""
    order = sorted(range(len(means)), key=means.__getitem__)
    return [order.index(i) + 1 for i in range(len(means))]


def _late_curves(results: list[VariantRuns], base: Optional[VariantRuns]) -> list[str]:
    """A table of the mean loss (and its rank) at the late evaluations, and how far the
    baseline still fell over its last interval compared with its spread over seeds."""
    steps = late_steps(results[0])
    if any(late_steps(result) != steps for result in results) or len(steps) < 2:
        return []  # runs evaluated at different steps: no common columns
    means = [
        [statistics.mean(curve[step] for curve in result.curves) for result in results]
        for step in steps
    ]
    column_ranks = [ranks(column) for column in means]
    rows = [
        [
            result.variant,
            *(f"{column[i]:.4f} ({rank[i]})" for column, rank in zip(means, column_ranks)),
            f"{means[-2][i] - means[-1][i]:.4f}",
        ]
        for i, result in enumerate(results)
    ]
    lines = [
        "## How settled the curves are",
        "",
        "Mean validation loss over seeds at late evaluations, with each variant's rank "
        f"(1 = lowest) in brackets; `last fall`: the mean's drop from step {steps[-2]} to "
        f"step {steps[-1]}.",
        "",
        markdown_table(["variant", *(f"step {step}" for step in steps), "last fall"], rows),
        "",
    ]
    lines.append(
        f"Ranking at step {steps[0]} and at step {steps[-1]}: "
        + ("the same." if column_ranks[0] == column_ranks[-1] else "different.")
    )
    if base is not None:
        i = results.index(base)
        fall, finals = means[-2][i] - means[-1][i], base.final_losses()
        lines.append(
            f"`{base.variant}` fell {fall:.4f} ({100 * fall / means[-2][i]:.2f}%) over "
            f"its last {steps[-1] - steps[-2]} steps; its seeds' final losses span "
            f"{max(finals) - min(finals):.4f}."
        )
    return lines + [""]


def _difference_note(baseline: str, present: bool) -> str:
    if not present:
        return f"No `{baseline}` run in this batch, so no differences from it are given."
    return (
        f"`vs {baseline}`: the variant's mean minus `{baseline}`'s, with SE = "
        "sqrt(s^2/n + s_b^2/n_b), the error of that difference of means over seeds (n/a "
        "with fewer than 2 seeds); `*` marks a difference larger than 2 SE. Lower loss is "
        "better."
    )
