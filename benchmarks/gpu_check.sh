#!/usr/bin/env bash
# The prepared GPU check (docs/GPU.md): CUDA-marked tests, then one table (train MFU eager/compiled, document-masked
# vs causal training at 32K, SambaY vs Transformer++ decode at 16K/32K prompts, peak memory), JSON + log under $OUT.
# Runs from the repository with the machine's own python3: no install (PYTHONPATH=src), no downloads.
#   bash benchmarks/gpu_check.sh          # on a CUDA machine, under 8 minutes on one H200
#   bash benchmarks/gpu_check.sh --dry    # the same logic on CPU at tiny sizes (tests/test_gpu_check.py)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  "$PY" benchmarks/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
exec "$PY" benchmarks/gpu_check.py "$@"
