"""Train every residual design a few steps at TP = 2 x PP = 2 (4 ranks) and save, and one
under DeepSpeed ZeRO-3 at TP = 2 x DP = 2: the checkpoints the Hugging Face export tests read.

``ddl+shortswa`` sets ``checkpoint.export_hf_on_finish``, exported as ``t2train train`` does
(a fresh process started by rank 0 of this torchrun world). Writes {variant: {"checkpoint",
"val_loss" (the run's validation loss at its last step), "exported" (folder or None)}}.

Order matters in one process: a run's data readers make a process group among themselves
only, and torch names groups by a per-rank counter, so groups for all ranks cannot be made
after a run whose readers are not all ranks. Both layouts' Megatron groups are made first,
and the DeepSpeed run (its setup makes groups) goes before the TP = 2 x PP = 2 runs (one
reader in four).
"""

from __future__ import annotations

from pathlib import Path

from common import finish, parse_args, use_layout, write_result

from t2train.config.loader import load_config
from t2train.export.on_finish import export_on_finish
from t2train.parallel.init import init_distributed
from t2train.train.loop import train

STEPS = 2
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=3e-3",
    "train.min_lr=3e-4",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "train.eval_interval=1000",
    "train.log_interval=1",
    "log.tensorboard=false",
    "log.diagnostics_interval=0",
    f"train.steps={STEPS}",
]
TP2_PP2 = ["parallel.tensor=2", "parallel.pipeline=2"]
ZERO3_TP2 = ["parallel.tensor=2", "train.engine=deepspeed", "deepspeed.zero_stage=3"]
VARIANTS = {  # name: (pipeline stages, overrides), TP = 2 everywhere; run in this order
    "depth_attn-zero3": (
        1,
        [
            *ZERO3_TP2,
            "model.residual=depth_attn",
            "model.depth_attn.window=2",
            "model.num_query_groups=2",
        ],
    ),
    "standard": (2, [*TP2_PP2, "model.num_query_groups=2", "model.tie_embeddings=false"]),
    "ddl": (2, [*TP2_PP2, "model.residual=ddl"]),
    "ddl_dv4": (2, [*TP2_PP2, "model.residual=ddl", "model.ddl.dv=4"]),
    "depth_attn": (2, [*TP2_PP2, "model.residual=depth_attn", "model.depth_attn.window=2"]),
    "attnres": (2, [*TP2_PP2, "model.residual=attnres"]),
    "block_attnres": (2, [*TP2_PP2, "model.residual=block_attnres", "model.attnres.block_size=2"]),
    "ddl+shortswa": (
        2,
        [
            *TP2_PP2,
            "model.residual=ddl",
            "model.shortswa.window=8",
            "checkpoint.export_hf_on_finish=true",
        ],
    ),
}


def main() -> None:
    args = parse_args([("--data", Path), ("--root", Path)])
    init_distributed()
    for pipeline in sorted({pipeline for pipeline, _ in VARIANTS.values()}):
        use_layout(2, pipeline, 1)
    result = {}
    for name, (pipeline, overrides) in VARIANTS.items():
        use_layout(2, pipeline, 1)
        config = load_config(
            overrides=[
                *TINY,
                *overrides,
                f"data.path={args.data}",
                f"log.run_dir={args.root / name}",
                "checkpoint.resume=none",
            ]
        )
        summary = train(config)
        exported = export_on_finish(config, summary)
        result[name] = {
            "checkpoint": str(summary.checkpoint),
            "val_loss": summary.val_losses[STEPS],
            "exported": str(exported) if exported else None,
        }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
    finish()
