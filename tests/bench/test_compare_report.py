"""``compare.md``'s numbers and figures from hand-made runs, the arithmetic written out.

Two variants, three seeds each, 100 tokens per step, evaluated at steps 0, 10 and 20:

* ``standard``: 6 training FLOPs per token, so step s is 600 s FLOPs; its whole run is
  12,000 FLOPs. Final losses 2.0, 2.2, 2.1: mean 2.1, sample std
  sqrt((0.1^2 + 0.1^2 + 0) / 2) = 0.1.
* ``ddl``: 8 FLOPs per token, 800 s FLOPs; losses 2.6, 2.8, 2.7 at step 10 and 1.6, 1.8, 1.7
  at step 20: final mean 1.7, std 0.1.

Equal FLOPs: the largest budget both reached is standard's whole run, 12,000 FLOPs, which
``ddl`` reaches at step 12,000 / 800 = 15, halfway between its evaluations at 10 and 20: its
losses there are (2.6 + 1.6) / 2 = 2.1, 2.3, 2.2, mean 2.2, std 0.1 (1,500 tokens).

Standard error of a difference of means: sqrt(0.1^2/3 + 0.1^2/3) = 0.08165, so 2 SE = 0.1633.
At equal tokens ddl - standard = 1.7 - 2.1 = -0.4, past 2 SE (marked ``*``); at equal FLOPs
2.2 - 2.1 = +0.1, within 2 SE (not marked).
"""

from __future__ import annotations

import struct

import pytest

from t2train.bench.compare_report import (
    Spread,
    VariantRuns,
    equal_flops_budget,
    format_report,
    standard_error_of_difference,
    versus,
)


def _runs() -> list[VariantRuns]:
    standard = VariantRuns(
        "standard",
        [{0: 5.0, 10: 3.0, 20: 2.0}, {0: 5.0, 10: 3.2, 20: 2.2}, {0: 5.0, 10: 3.1, 20: 2.1}],
        100,
        6.0,
        1_000_000,
    )
    ddl = VariantRuns(
        "ddl",
        [{0: 5.0, 10: 2.6, 20: 1.6}, {0: 5.0, 10: 2.8, 20: 1.8}, {0: 5.0, 10: 2.7, 20: 1.7}],
        100,
        8.0,
        1_250_000,
    )
    return [standard, ddl]


def _table(report: str, heading: str) -> dict[str, list[str]]:
    """The rows of the table under ``heading``, by variant."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("| ") and not set(line) <= set("|-"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def test_loss_at_equal_flops_is_interpolated_linearly_in_flops():
    standard, ddl = _runs()
    assert equal_flops_budget([standard, ddl]) == pytest.approx(12_000)
    assert ddl.losses_at_flops(12_000) == pytest.approx([2.1, 2.3, 2.2])
    assert standard.losses_at_flops(12_000) == pytest.approx([2.0, 2.2, 2.1])
    # a quarter of the way from step 10 (8,000 FLOPs) to step 20: 2.6 + 0.25 * (1.6 - 2.6)
    assert ddl.losses_at_flops(10_000)[0] == pytest.approx(2.35)
    with pytest.raises(ValueError, match="outside"):
        standard.losses_at_flops(12_001)


def test_difference_is_marked_only_past_two_standard_errors():
    base, better, close = Spread([2.0, 2.2, 2.1]), Spread([1.6, 1.8, 1.7]), Spread([2.1, 2.3, 2.2])
    assert base.std == pytest.approx(0.1)
    assert standard_error_of_difference(better, base) == pytest.approx(0.081650, abs=1e-6)
    assert versus(better, base, False) == "-0.4000 (SE 0.0816) *"
    assert versus(close, base, False) == "+0.1000 (SE 0.0816)"
    assert versus(base, base, True) == "(baseline)"
    assert versus(Spread([1.0]), Spread([2.0]), False) == "-1.0000 (SE n/a)"  # one seed


def test_report_tables_at_equal_tokens_and_equal_flops():
    report = format_report(_runs(), "standard", ["dataset: hand-made"], ["a.png", "b.png"])
    tokens = _table(report, "## At equal tokens: 2000 tokens per run")
    assert tokens["standard"] == [
        "standard",
        "3",
        "1.00",
        "6.000e+00",
        "1.200e+04",
        "2.1000",
        "0.1000",
        "2.0000-2.2000",
        "(baseline)",
    ]
    assert tokens["ddl"] == [
        "ddl",
        "3",
        "1.25",
        "8.000e+00",
        "1.600e+04",
        "1.7000",
        "0.1000",
        "1.6000-1.8000",
        "-0.4000 (SE 0.0816) *",
    ]
    flops = _table(report, "## At equal training FLOPs: 1.200e+04")
    assert flops["standard"] == [
        "standard",
        "2000",
        "20.0",
        "2.1000",
        "0.1000",
        "2.0000-2.2000",
        "(baseline)",
    ]
    assert flops["ddl"] == [
        "ddl",
        "1500",
        "15.0",
        "2.2000",
        "0.1000",
        "2.1000-2.3000",
        "+0.1000 (SE 0.0816)",
    ]
    assert "- dataset: hand-made" in report
    assert "![a.png](a.png)" in report and "![b.png](b.png)" in report
    without_baseline = format_report(_runs()[1:], "standard", [], [])
    assert "No `standard` run in this batch" in without_baseline
    assert _table(without_baseline, "## At equal tokens")["ddl"][-1] == "n/a"


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", path
    return struct.unpack(">II", header[16:24])


def test_figures_are_pngs_of_the_stated_size(tmp_path):
    from t2train.bench.compare_figures import DPI, SIZE_INCHES, write_figures

    runs = _runs()
    names = write_figures(runs, equal_flops_budget(runs), tmp_path)
    assert names == ["val_loss_vs_tokens.png", "val_loss_vs_flops.png"]
    expected = (round(SIZE_INCHES[0] * DPI), round(SIZE_INCHES[1] * DPI))
    assert expected == (1200, 500)
    for name in names:
        assert png_size(tmp_path / name) == expected


def test_late_curves_show_ranks_and_the_baselines_last_fall():
    """Evaluations every 10 steps to 80: the late columns are steps 40 (half), 60 (three
    quarters), 70 and 80. ``ddl`` leads at 40 and 60 but ``standard`` passes it by 70."""
    from t2train.bench.compare_report import late_steps, ranks

    def curves(late: dict[int, list[float]]) -> list[dict[int, float]]:
        early = {step: 9.0 for step in range(0, 40, 10)} | {50: 5.0}
        return [early | {step: losses[seed] for step, losses in late.items()} for seed in range(2)]

    standard = VariantRuns(
        "standard",
        curves({40: [4.0, 4.2], 60: [3.6, 3.8], 70: [3.0, 3.2], 80: [2.9, 3.0]}),
        100,
        6.0,
        1_000_000,
    )
    ddl = VariantRuns(
        "ddl",
        curves({40: [3.0, 3.0], 60: [3.5, 3.5], 70: [3.3, 3.3], 80: [3.25, 3.25]}),
        100,
        6.0,
        1_000_000,
    )
    assert late_steps(standard) == [40, 60, 70, 80]
    assert ranks([3.1, 2.0, 5.0]) == [2, 1, 3]
    report = format_report([standard, ddl], "standard", [], [])
    rows = _table(report, "## How settled the curves are")
    # standard's means: 4.1, 3.7, 3.1, 2.95; ddl's: 3.0, 3.5, 3.3, 3.25
    assert rows["standard"][1:] == [
        "4.1000 (2)",
        "3.7000 (2)",
        "3.1000 (1)",
        "2.9500 (1)",
        "0.1500",
    ]
    assert rows["ddl"][1:] == ["3.0000 (1)", "3.5000 (1)", "3.3000 (2)", "3.2500 (2)", "0.0500"]
    assert "Ranking at step 40 and at step 80: different." in report
    # 0.15 / 3.1 = 4.84%; final losses 2.9 and 3.0 span 0.1
    assert (
        "`standard` fell 0.1500 (4.84%) over its last 10 steps; its seeds' final losses "
        "span 0.1000."
    ) in report
