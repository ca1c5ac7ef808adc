"""What only a machine with several GPUs proves, in one launch of 2 ranks (one GPU each):
NCCL process groups; TP = 2 and TP = 2 with sequence parallelism over NVLink; PP = 2 with the
exact-size hops of a multi-stream design on CUDA tensors; PP = 2 x VPP = 2 with the depth
cache's device buffers (cached hops); DP = 2 with Megatron DDP and with DeepSpeed ZeRO-1, -2
and -3. Each layout trains the DP = 2 run's step-0 weights on the same batches
(``tests/workers/multi_device.py``); each ZeRO stage matches the Megatron engine's losses.

``make gpu-check-multi`` (or ``pytest -m multi_gpu``) runs it on 2 GPUs; it is skipped with
the reason elsewhere. Its gloo dry run (same worker, same runs, on the CPU) runs in the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchrun_helper import REPO, run_torchrun

RUNS = ";".join(
    [
        # the stream crosses each hop as n units, the mixer's window attention inside
        "1x1x1,2x1x1,2x1x1s,1x2x1|model.residual=mhc,model.shortswa.window=4",
        # sources that never change: kept on the receiving rank, not resent (VPP = 2)
        "1x1x1,1x2x2|model.residual=attnres,parallel.depth_cache=cached",
    ]
)
DESIGN = "ddl"  # ZeRO: a non-standard design (the CPU suite's second one)
# fp32 and eager on every device: the layouts then differ only in reduction order (GPU:
# NCCL and cuBLAS, hence 1e-4 there; gloo: 1e-5, as tests/test_layouts.py).
OVERRIDES = "train.precision=fp32,model.fusions=none"
BUNDLE_DATA = REPO / ".gpu-bundle" / "data" / "shakespeare-bpe4k-s4096"


def _run(tmp_path: Path, data: Path, **env: str) -> dict:
    return run_torchrun(
        "multi_device.py",
        2,
        [
            "--scratch",
            str(tmp_path),
            "--runs",
            RUNS,
            "--data",
            str(data),
            "--design",
            DESIGN,
            "--overrides",
            OVERRIDES,
        ],
        tmp_path / "result.json",
        timeout=900,
        **env,
    )


def _check(result: dict, layout_tolerance: float, engine_tolerance: float) -> None:
    for run, layouts in result["layouts"].items():
        reference = layouts["1x1x1"]["losses"]  # DP = 2
        assert len(reference) == 4  # 3 steps, then a forward with the final parameters
        for layout, got in layouts.items():
            gaps = [abs(a - b) for a, b in zip(got["losses"], reference)]
            assert max(gaps) < layout_tolerance, (run, layout, got["losses"], reference)
    pipelined = result["layouts"][RUNS.split(";")[0]]["1x2x1"]["traffic"]
    assert pipelined["pipeline/forward_data_bytes"] > 0  # the hops carried the stream
    megatron = result["engines"].pop("megatron")
    assert len(megatron) == 3 and sorted(result["engines"]) == ["zero1", "zero2", "zero3"]
    for stage, losses in result["engines"].items():
        gaps = [abs(losses[step] - megatron[step]) for step in megatron]
        assert losses.keys() == megatron.keys() and max(gaps) < engine_tolerance, (stage, gaps)


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=(
        f"needs 2 or more CUDA devices ({torch.cuda.device_count()} here): run `make "
        "gpu-check-multi` on a multi-GPU machine"
    ),
)
def test_layouts_and_zero_on_two_gpus(tmp_path):
    if not (BUNDLE_DATA / "index.json").exists():
        pytest.skip(f"{BUNDLE_DATA}: no prepared dataset (make gpu-bundle, and carry it)")
    result = _run(tmp_path, BUNDLE_DATA)
    assert all("(nccl)" in device for device in result["devices"]), result["devices"]
    _check(result, layout_tolerance=1e-4, engine_tolerance=1e-3)


@pytest.mark.slow
def test_the_same_launch_on_gloo(tmp_path, shakespeare):
    """The dry run of the test above: the same worker and runs, with no GPU visible."""
    result = _run(tmp_path, shakespeare, CUDA_VISIBLE_DEVICES="")
    assert result["devices"] == ["cpu (gloo)"] * 2
    _check(result, layout_tolerance=1e-5, engine_tolerance=1e-4)
