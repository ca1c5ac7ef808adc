"""Train every residual design a few steps at TP = 2 x PP = 2 (4 ranks) and save; then a
DeepSpeed ZeRO-3 run at TP = 2 x DP = 2: the checkpoints the Hugging Face export tests read.

``ddl+shortswa`` sets ``checkpoint.export_hf_on_finish``, exported as ``t2train train`` does
(a fresh process started by rank 0 of this torchrun world). The DeepSpeed run must come last:
DeepSpeed creates process groups on some ranks only, after which Megatron's groups for
another layout cannot be created (gloo's group names no longer agree). Writes {variant: {"checkpoint",
"val_loss" (the run's validation loss at its last step), "exported" (folder or None)}}.
"""

from __future__ import annotations

from pathlib import Path

from common import parse_args, use_layout, write_result

from t2train.config.loader import load_config
from t2train.export.on_finish import export_on_finish
from t2train.parallel.init import init_distributed
from t2train.train.loop import train

STEPS = 2
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.lr=3e-3", "train.min_lr=3e-4", "train.warmup_steps=1", "train.eval_batches=1",
        "train.eval_interval=1000", "train.log_interval=1", "log.tensorboard=false",
        "log.diagnostics_interval=0", f"train.steps={STEPS}"]
TP2_PP2 = ["parallel.tensor=2", "parallel.pipeline=2"]
ZERO3_TP2 = ["parallel.tensor=2", "train.engine=deepspeed", "deepspeed.zero_stage=3"]
VARIANTS = {  # name: (layout, overrides)
    "standard": (TP2_PP2, ["model.num_query_groups=2", "model.tie_embeddings=false"]),
    "ddl": (TP2_PP2, ["model.residual=ddl"]),
    "ddl_dv4": (TP2_PP2, ["model.residual=ddl", "model.ddl.dv=4"]),
    "depth_attn": (TP2_PP2, ["model.residual=depth_attn", "model.depth_attn.window=2"]),
    "attnres": (TP2_PP2, ["model.residual=attnres"]),
    "block_attnres": (TP2_PP2, ["model.residual=block_attnres", "model.attnres.block_size=2"]),
    "ddl+shortswa": (TP2_PP2, ["model.residual=ddl", "model.shortswa.window=8",
                               "checkpoint.export_hf_on_finish=true"]),
    "depth_attn-zero3": (ZERO3_TP2, ["model.residual=depth_attn", "model.depth_attn.window=2",
                                     "model.num_query_groups=2"]),
}


def main() -> None:
    args = parse_args([("--data", Path), ("--root", Path)])
    init_distributed()
    result = {}
    for name, (layout, overrides) in VARIANTS.items():
        use_layout(2, 2 if layout is TP2_PP2 else 1, 1)
        config = load_config(overrides=[*TINY, *layout, *overrides, f"data.path={args.data}",
                                        f"log.run_dir={args.root / name}",
                                        "checkpoint.resume=none"])
        summary = train(config)
        exported = export_on_finish(config, summary)
        result[name] = {"checkpoint": str(summary.checkpoint),
                        "val_loss": summary.val_losses[STEPS],
                        "exported": str(exported) if exported else None}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
