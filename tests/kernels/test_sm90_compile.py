"""Every Triton kernel compiles for an H100 (sm_90) as its wrapper launches it, without a GPU
(``compile_for_sm90.py``): the interpreter accepted two kernels that Triton's compiler
rejects (a value defined in a loop read after it; a literal ``True`` passed as a constant)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "compile_for_sm90.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("sm_90: ")]
    kernels = {line.split()[1].split(" ")[0] for line in compiled}
    assert {
        f"t2train.kernels.{name}"
        for name in (
            "window_attention._fwd_kernel",
            "window_attention._dkdv_kernel",
            "window_attention._one_query_fwd_kernel",
            "window_attention._one_query_bwd_kernel",
            "ddl_update._bwd_kernel",
            "fp32_linear._fwd_kernel",
            "fp32_linear._bwd_kernel",
            "depth_mix._phase1_bwd_kernel",
            "depth_mix._phase2_bwd_kernel",
            "stream_mix._write_bwd",
        )
    } <= kernels, kernels
    # Block AttnRes reads its sources through a table of their addresses: the compiler sees
    # loaded pointers, and vectorises their loads only with the alignment hint (without it,
    # every bf16 element was a load of its own)
    table_reads = [
        line for line in compiled if "depth_mix._phase1" in line and "'ALIGNED': True" in line
    ]
    assert len(table_reads) >= 3, compiled
    assert all(not line.endswith("16-byte loads: 0") for line in table_reads), table_reads
