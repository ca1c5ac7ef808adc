"""Train 3 steps in several (TP, PP, VPP) layouts from the same weights; report losses.

``--runs`` is a ``;``-separated list of ``LAYOUTS|OVERRIDES`` (layouts like ``1x2x2`` and
overrides like ``model.residual=ddl``, each ``,``-separated). For each, the first layout
trains from its seed and saves a step-0 checkpoint; every other layout loads that checkpoint
(Megatron resharding) and trains on the same global batches.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from common import finish, parse_args, use_layout, write_result

from t2train.config.loader import load_config
from t2train.engine.megatron.checkpoint import load_checkpoint, save_checkpoint
from t2train.engine.megatron.setup import build_training_objects
from t2train.engine.megatron.step import evaluate, train_step
from t2train.parallel.init import init_distributed, set_seed

VOCAB, SEQ, MICRO, GLOBAL, STEPS = 128, 8, 1, 4, 3


def global_batches():
    """The same tokens on every rank, on this rank's device (a GPU under NCCL)."""
    g = torch.Generator().manual_seed(3)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g).to(device)
        yield [
            {"tokens": tokens[i : i + MICRO, :-1], "labels": tokens[i : i + MICRO, 1:]}
            for i in range(0, GLOBAL, MICRO)
        ]


def run_layout(layout: str, overrides: list[str], checkpoint: Path, load: bool) -> dict:
    """``layout`` is TPxPPxVPP, with a trailing ``s`` for sequence parallelism."""
    tp, pp, vpp = (int(n) for n in layout.rstrip("s").split("x"))
    topology = use_layout(tp, pp, vpp)
    set_seed(11, topology)
    config = load_config(
        overrides=[
            "data.path=unused",
            "model.num_layers=4",
            "model.hidden_size=32",
            "model.num_attention_heads=4",
            f"model.seq_length={SEQ}",
            f"parallel.tensor={tp}",
            f"parallel.pipeline={pp}",
            f"parallel.virtual_pipeline={vpp}",
            f"train.micro_batch_size={MICRO}",
            f"train.global_batch_size={GLOBAL}",
            f"parallel.sequence_parallel={layout.endswith('s')}",
            "train.warmup_steps=1",
            "train.steps=3",
            *overrides,
        ]
    )
    objs = build_training_objects(config, VOCAB)
    if load:
        load_checkpoint(checkpoint, objs)
    else:
        save_checkpoint(checkpoint.parent, 0, objs, {})
    dp, dp_rank = topology.dp_size, topology.dp_rank
    per_replica = GLOBAL // MICRO // dp
    results = [
        train_step(objs, batch[dp_rank * per_replica : (dp_rank + 1) * per_replica])
        for batch in global_batches()
    ]
    # One more forward after the last update: equal only if every parameter ended up equal.
    final = evaluate(
        objs, [next(global_batches())[dp_rank * per_replica : (dp_rank + 1) * per_replica]]
    )
    return {"losses": [r.loss for r in results] + [final], "traffic": results[0].traffic}


def main() -> None:
    args = parse_args([("--scratch", str), ("--runs", str)])
    init_distributed()
    results = {}
    for number, run in enumerate(args.runs.split(";")):
        layouts, overrides = run.split("|")
        checkpoint = Path(args.scratch) / str(number) / "step_00000000"
        results[run] = {}
        for index, layout in enumerate(layouts.split(",")):
            results[run][layout] = run_layout(
                layout, overrides.split(","), checkpoint, load=index > 0
            )
            dist.barrier()
    write_result(args.out, {"runs": results})


if __name__ == "__main__":
    main()
    finish()
