#!/bin/bash
# 1b preset (24 x 2048, GQA 8 groups, ~1.2B parameters) on 2 nodes x 8 GPUs (80 GB).
#
# Layout: TP 1 x PP 1 x DP 16. The model fits one GPU in bf16, so every GPU is a data-parallel
# replica; the distributed optimizer (on in the preset) shards Adam's state over the 16 ranks.
# Global batch 512 = micro batch 4 x DP 16 x 8 accumulated micro-batches per step.
# More nodes: --nodes=4 gives DP 32 (4 micro-batches per rank), still 512 sequences per step.
#
#   DATA=/data/my-corpus-bpe32k slurm/examples/1b.sh [section.field=value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p logs
PRESET=1b sbatch --job-name=t2train-1b --nodes=2 --gpus-per-node=8 --time=24:00:00 \
    slurm/pretrain.sbatch "$@"
