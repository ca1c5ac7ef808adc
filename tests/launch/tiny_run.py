"""Overrides shared by the launcher tests' training runs."""

# A model small enough for 4 CPU processes on 2 cores; tensor-parallel pairs need 4 heads.
TINY_MODEL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.min_lr=3e-4",
    "train.warmup_steps=5",
    "train.eval_batches=2",
    "train.log_interval=1",
]
