"""GPU check, kernels: ``t2train.kernels.bench`` forward+backward at each plan preset's shapes.

On the GPU in bf16 against eager, ``torch.compile`` and FlexAttention; in the dry run in fp32
on the CPU with the Triton interpreter (its bf16 ``tl.dot`` is wrong) and dynamo's eager
backend, which only proves the harness runs.
"""

from __future__ import annotations

import time

from t2train.bench.gpu_plan import Plan

MODE = "fwd+bwd"


def run(section, plan: Plan) -> None:
    import torch

    from t2train.config.loader import load_config
    from t2train.kernels import bench

    rt = (bench.Runtime("cpu", torch.float32) if plan.dry_run
          else bench.Runtime("cuda", torch.bfloat16))
    section.data.update(mode=MODE, dtype=str(rt.dtype).removeprefix("torch."),
                        header=bench.TABLE_HEADER)
    torch.manual_seed(0)
    for label, preset, overrides in plan.kernel_presets:
        config = load_config(preset, None, ["data.path=unused", *overrides])
        shapes = bench.shapes_from_config(config, label)
        section.data.setdefault("shapes", {})[label] = vars(shapes) | {
            "ddl_widths": list(shapes.ddl_widths)}
        for case in bench.cases(shapes, rt):
            estimate = section.last_item_seconds(default=30.0)
            if not section.fits(estimate):
                section.add({"kernel": case.kernel, "preset": label, "shape": case.shape,
                             "status": "skipped", "reason": section.no_time(estimate)})
                continue
            started = time.monotonic()
            rows = [bench.row_dict(row) for row in bench.run_case(case, rt, [MODE])]
            failed = [row["error"] for row in rows if row["impl"] == "triton" and row["error"]]
            section.add({"kernel": case.kernel, "preset": label, "shape": case.shape,
                         "status": "error" if failed else "ok", "rows": rows,
                         "reason": f"the Triton kernel failed: {failed[0]}" if failed else "",
                         "seconds": time.monotonic() - started})
            del case
            if rt.on_cuda:
                torch.cuda.empty_cache()
