"""Two ranks, one device each: NCCL on GPUs, gloo on the CPU (tests/test_multi_gpu.py).

``--runs``: layout runs as ``layout_equivalence.py`` takes them (TP = 2, with sequence
parallelism, PP = 2, PP = 2 x VPP = 2, each from the DP = 2 run's step-0 weights on the same
batches). ``--data``: then the Megatron engine and DeepSpeed ZeRO-1, -2 and -3 at DP = 2 on that
prepared dataset (``engine_equivalence.py``'s runs, design ``--design``). One process group
for both, so the first multi-GPU machine proves everything in one launch. Writes
{"devices": [...], "layouts": {run: {layout: {"losses", "traffic"}}}, "engines": {run: {step:
loss}}}.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from common import finish, parse_args, use_layout, write_result
from engine_equivalence import ENGINES, TINY
from layout_equivalence import run_layout

from t2train.config.loader import load_config
from t2train.parallel.init import init_distributed
from t2train.train.loop import train

ENGINE_STEPS = 3  # each saves its last step: the ZeRO checkpoint's collectives run too


def main() -> None:
    args = parse_args(
        [
            ("--scratch", Path),
            ("--runs", str),
            ("--data", Path),
            ("--design", str),
            ("--overrides", str),
        ]
    )
    init_distributed()
    extra = args.overrides.split(",")
    devices = [None] * dist.get_world_size()
    here = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    dist.all_gather_object(devices, f"{here} ({dist.get_backend()})")
    layouts = {}
    for number, run in enumerate(args.runs.split(";")):
        names, overrides = run.split("|")
        checkpoint = args.scratch / str(number) / "step_00000000"
        layouts[run] = {
            layout: run_layout(layout, [*overrides.split(","), *extra], checkpoint, load=index > 0)
            for index, layout in enumerate(names.split(","))
        }
        dist.barrier()
    use_layout(1, 1, 1)  # Megatron's globals of a layout without virtual stages
    engines = {}
    for name, engine in ENGINES.items():
        config = load_config(
            overrides=[
                *TINY,
                f"model.residual={args.design}",
                f"data.path={args.data}",
                *engine,
                *extra,
                f"train.steps={ENGINE_STEPS}",
                "log.diagnostics_interval=0",
                f"log.run_dir={args.scratch / name}",
                "checkpoint.resume=none",
            ]
        )
        engines[name] = train(config).losses
    write_result(args.out, {"devices": devices, "layouts": layouts, "engines": engines})


if __name__ == "__main__":
    main()
    finish()
