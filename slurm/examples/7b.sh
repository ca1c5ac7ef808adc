#!/bin/bash
# 7b preset (Llama-7B shape: 32 x 4096, SwiGLU 11008) on 4 nodes x 8 GPUs (80 GB).
#
# Layout: TP 2 x PP 2 x DP 8 (world 32), in Megatron's rank order (tensor fastest, then
# data, then pipeline): tensor-parallel pairs are consecutive ranks inside a node (NVLink),
# with sequence parallelism; pipeline stage 0 (layers 0-15) is ranks 0-15 on two nodes and
# stage 1 (layers 16-31) ranks 16-31 on the other two (torchrun hands each node 8
# consecutive ranks), so only per-micro-batch activations cross between the node pairs;
# each stage's 8 data-parallel replicas span its two nodes. Full
# activation recompute and the distributed optimizer are on in the preset.
# Global batch 1024 = micro batch 1 x DP 8 x 128 micro-batches per step (which also keeps the
# 1F1B pipeline bubble small: (PP - 1) / 128).
# More nodes: 8 nodes give DP 16; the layout stays TP 2 x PP 2.
#
#   DATA=/data/my-corpus-bpe32k slurm/examples/7b.sh [section.field=value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p logs
PRESET=7b sbatch --job-name=t2train-7b --nodes=4 --gpus-per-node=8 --time=48:00:00 \
    slurm/pretrain.sbatch "$@"
