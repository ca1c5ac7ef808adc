"""t2train.launch: torchrun and SLURM launchers."""
