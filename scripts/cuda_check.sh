#!/usr/bin/env bash
# CUDA checks for a GPU machine (the CI here is CPU-only; these tests skip without CUDA).
# Uses the machine's own python3 with torch/transformers/safetensors; no download needed.
# Usage: scripts/cuda_check.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.__version__, torch.cuda.get_device_name(0))"
PYTHONPATH=src python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py "$@"
