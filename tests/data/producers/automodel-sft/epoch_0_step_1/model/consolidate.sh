#!/usr/bin/env bash
set -euo pipefail

# Offline HF safetensors consolidation helper.
# Defaults are conservative for login nodes and small CPU machines. For large
# checkpoints, run this on a CPU compute node and increase parallelism. Work is
# split across NPROC_PER_NODE worker processes, and each process uses NUM_THREADS
# writer threads; keep NPROC_PER_NODE * NUM_THREADS within your CPU allocation.
# Example for an 80-core CPU node:
#   NPROC_PER_NODE=16 NUM_THREADS=5 bash "$0"
# Slurm example:
#   sbatch --cpus-per-task=80 --wrap='NPROC_PER_NODE=16 NUM_THREADS=5 bash /path/to/consolidate.sh'
# Optional: set CAST_DTYPE=bf16 to request a floating-point dtype cast during export.
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
NUM_THREADS="${NUM_THREADS:-5}"
CAST_DTYPE="${CAST_DTYPE:-}"
PYTHON="${PYTHON:-python3}"
TORCHRUN="${TORCHRUN:-torchrun}"
CONSOLIDATION_TOOL="${CONSOLIDATION_TOOL:-tools/offline_hf_consolidation.py}"
CAST_DTYPE_ARGS=()
if [[ -n "${CAST_DTYPE}" ]]; then
  CAST_DTYPE_ARGS=(--cast-dtype "${CAST_DTYPE}")
fi
if [[ ! -f "${CONSOLIDATION_TOOL}" ]]; then
  echo "Could not find offline consolidation tool at ${CONSOLIDATION_TOOL}." >&2
  echo "Run from the AutoModel repo root or set CONSOLIDATION_TOOL=/path/to/tools/offline_hf_consolidation.py." >&2
  exit 1
fi

if [[ "${NPROC_PER_NODE}" -gt 1 ]]; then
  "${TORCHRUN}" --nproc-per-node="${NPROC_PER_NODE}" "${CONSOLIDATION_TOOL}" \
    --backend gloo \
    --num-threads "${NUM_THREADS}" \
    --model-name "None" \
    --input-dir "automodel-sft/epoch_0_step_1/model" \
    --output-dir "automodel-sft/epoch_0_step_1/model/consolidated" \
    "${CAST_DTYPE_ARGS[@]}"
else
  "${PYTHON}" "${CONSOLIDATION_TOOL}" \
    --backend gloo \
    --num-threads "${NUM_THREADS}" \
    --model-name "None" \
    --input-dir "automodel-sft/epoch_0_step_1/model" \
    --output-dir "automodel-sft/epoch_0_step_1/model/consolidated" \
    "${CAST_DTYPE_ARGS[@]}"
fi
