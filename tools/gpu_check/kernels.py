"""GPU check, kernels: ``t2train.bench.kernels``' cases (each Triton kernel against eager,
``torch.compile`` and the peers a case adds) at the presets' shapes, forward+backward, while
the section's time lasts. On the GPU in bf16; in the dry run in fp32 on the CPU with the
Triton interpreter (its bf16 ``tl.dot`` is wrong), which only proves the harness runs.
"""

from __future__ import annotations

import time

from t2train.bench import kernel_cases as bench
from t2train.bench.kernels import preset_shapes
from t2train.kernels.benchmark import Runtime
from tools.gpu_check.plan import Plan

CHECK_MODE = "fwd+bwd"


def run(section, plan: Plan) -> None:
    import torch

    rt = Runtime("cpu", torch.float32) if plan.dry_run else Runtime("cuda", torch.bfloat16)
    section.data.update(
        mode=CHECK_MODE,
        dtype=str(rt.dtype).removeprefix("torch."),
        header=bench.TABLE_HEADER,
        shapes={},
    )
    torch.manual_seed(0)
    for label, preset, overrides in plan.kernel_presets:
        shapes = preset_shapes(label, preset, overrides)
        section.data["shapes"][label] = shapes.describe()
        for case in plan.items(bench.cases(shapes, rt)):
            estimate = section.next_item_seconds(default=30.0)
            if not section.fits(estimate):
                section.add(
                    {
                        "kernel": case.kernel,
                        "preset": label,
                        "shape": case.shape,
                        "status": "skipped",
                        "reason": section.no_time(estimate),
                    }
                )
                continue
            started = time.monotonic()
            rows = [bench.row_dict(row) for row in bench.run_case(case, rt, [CHECK_MODE])]
            failed = [row["error"] for row in rows if row["impl"] == "triton" and row["error"]]
            section.add(
                {
                    "kernel": case.kernel,
                    "preset": label,
                    "shape": case.shape,
                    "status": "error" if failed else "ok",
                    "rows": rows,
                    "reason": f"the Triton kernel failed: {failed[0]}" if failed else "",
                    "seconds": time.monotonic() - started,
                }
            )
            if rt.on_cuda:
                torch.cuda.empty_cache()
