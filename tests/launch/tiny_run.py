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

# The two-rank run (tensor-parallel pair, one data reader) that the restart, preemption and
# soak tests interrupt, and the uninterrupted reference they are compared with
# (``uninterrupted`` in conftest.py): 12 steps, a checkpoint every 3.
TWO_RANK_STEPS = 12
TWO_RANK_RUN = [
    *TINY_MODEL,
    "parallel.tensor=2",
    f"train.steps={TWO_RANK_STEPS}",
    f"train.eval_interval={TWO_RANK_STEPS}",
    "train.eval_batches=1",
    "checkpoint.interval=3",
    "log.diagnostics_interval=0",
    "log.tensorboard=false",
    # a survivor whose peer died mid-collective: gloo fails it at once; a save under load
    # takes seconds, so this only bounds a hang
    "parallel.collective_timeout_mins=1",
]
