"""Tensor parallelism on CPU/gloo with 2 real ranks: TP=2 equals TP=1."""

import pytest

from torchrun_helper import run_torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("extra", ["", "model.num_query_groups=2"])
def test_tp2_forward_backward_equals_tp1(tmp_path, extra):
    result = run_torchrun(
        "tp_equivalence.py",
        2,
        ["--scratch", str(tmp_path / "ckpt"), "--extra", extra],
        tmp_path / "result.json",
    )
    assert abs(result["loss_tp1"] - result["loss_tp2"]) < 1e-5
    assert result["grad_scale"] > 0
    worst = max(result["grad_diffs"].items(), key=lambda item: item[1])
    assert worst[1] < 1e-5, f"gradient of {worst[0]} differs by {worst[1]}"
    assert len(result["grad_diffs"]) >= 10  # every parameter compared, not a subset
