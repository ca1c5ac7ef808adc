#!/usr/bin/env bash
# The GPU check on a fresh, offline GPU machine, from the repository root, in one command:
#   bash tools/gpu_check.sh OUT_DIR
# Installs .gpu-bundle/ (made by `make gpu-bundle` where there is network) without replacing
# anything installed, then writes OUT_DIR/gpu-report.md, gpu-report.json and gpu-check.log.
set -uo pipefail
out=${1:?usage: bash tools/gpu_check.sh OUT_DIR}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
"$python" tools/gpu_install.py --bundle .gpu-bundle 2>&1 | tee "$out/gpu-check.log"
"$python" -m t2train.bench.gpu_check --out "$out" --data .gpu-bundle/data/shakespeare-bpe4k-s4096
status=$?
sed -n '1,/^## Environment/p' "$out/gpu-report.md" 2>/dev/null  # the verdicts
exit $status
