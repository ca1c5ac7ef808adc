"""The benchmark runs anywhere: without CUDA it says so and succeeds, and ``--dry-run`` runs
its cases on the CPU."""

import torch

from t2train.bench import kernels


def test_without_cuda_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_dry_run_runs_every_asked_case_on_the_cpu(tmp_path, capsys, monkeypatch):
    """``--dry-run``: the separate invocation's cases at the dry-run shapes on the CPU, every
    Triton row timed, the rows written as JSON; it asks for the interpreter itself (read
    when a kernel's module is first imported, which a fresh process does in the run)."""
    import json
    import os

    monkeypatch.delenv("TRITON_INTERPRET")

    assert (
        kernels.main(
            [
                "--dry-run",
                "--only",
                "stream_mix",
                "--only",
                "hc_stream",
                "--mode",
                "fwd+bwd",
                "--json",
                str(tmp_path / "rows.json"),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    triton = {row["kernel"]: row for row in rows if row["impl"] == "triton"}
    assert set(triton) == {"stream_read", "stream_write", "hc_read", "hc_write"}
    assert all(row["ms"] is not None and not row["error"] for row in triton.values()), triton
    assert "| stream_write | tiny |" in capsys.readouterr().out
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_the_cli_command_runs_it_and_refuses_an_unknown_kernel_naming_the_known(capsys):
    """``t2train bench kernels`` is the same benchmark; an unknown --only or --mode is one
    line naming what exists."""
    import re

    import pytest

    from t2train.cli import main

    for flag, value, listed in (("--only", "nope", "delta_write"), ("--mode", "bwd", "fwd+bwd")):
        with pytest.raises(
            SystemExit, match=f"error: {flag} {value}: one of .*{re.escape(listed)}"
        ):
            main(["bench", "kernels", "--dry-run", flag, value])


def test_layers_of_each_asked_variant_against_the_baseline(tmp_path, capsys):
    """``--layers``: the baseline's decoder and each asked variant's, timed per layer with
    the ratio to the baseline's, in the table and the JSON; an unknown variant is one line
    naming the known."""
    import json

    import pytest

    from t2train.residual import BASELINE

    out = tmp_path / "rows.json"
    args = ["--dry-run", "--only", "fp32_linear", "--mode", "fwd", "--json", str(out)]
    assert kernels.main([*args, "--layers", "hc+shortswa"]) == 0
    costs = {row["variant"]: row for row in json.loads(out.read_text())["layers"]}
    assert list(costs) == [BASELINE, "hc+shortswa"]
    assert all(row["ms_per_layer"] > 0 and not row["error"] for row in costs.values()), costs
    assert costs[BASELINE]["vs_baseline"] == 1.0
    ratio = costs["hc+shortswa"]["ms_per_layer"] / costs[BASELINE]["ms_per_layer"]
    assert costs["hc+shortswa"]["vs_baseline"] == pytest.approx(ratio)
    assert costs[BASELINE]["layers"] == 2 and costs[BASELINE]["peak_mib"] is None  # no CUDA
    assert "| hc+shortswa | tiny | 2 |" in capsys.readouterr().out
    assert kernels.main(args) == 0  # --only alone: no layers
    assert json.loads(out.read_text())["layers"] == []
    with pytest.raises(SystemExit, match=r"error: --layers nope: one of .*hc\+shortswa"):
        kernels.main([*args, "--layers", "nope"])
