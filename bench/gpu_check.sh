#!/usr/bin/env bash
# The CUDA checks of bench/gpu_check.py on one GPU (< 8 minutes on an H100-class GPU), one results file.
#   bench/gpu_check.sh [RESULTS.json]          default: gpu_check.json
#   bench/gpu_check.sh --dry-run [RESULTS.json]   tiny sizes on the CPU (what the test suite runs)
# PYTHON selects the interpreter (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
dry=()
if [[ "${1:-}" == "--dry-run" ]]; then
  dry=(--dry-run)
  shift
fi
out="${1:-gpu_check.json}"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# Kill the whole check if it overruns its budget (8 minutes), keeping what it printed.
exec timeout 480 "$py" bench/gpu_check.py "${dry[@]}" --out "$out"
