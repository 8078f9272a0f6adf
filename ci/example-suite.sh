#!/usr/bin/env bash
# Runs the example suite against real vLLM: on the CPU with the built-in tiny model when no NVIDIA GPU is present,
# on the GPU with the real models otherwise. Sets up .venv first (idempotent).
#   bash ci/example-suite.sh                 # tier 8gb by default
#   VLLM_GPU=24gb bash ci/example-suite.sh   # another tier; extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup-venv.sh
args=(example_suite "--vllm-gpu=${VLLM_GPU:-8gb}" --vllm-results=results/example-suite.json
      --vllm-markdown=results/example-suite.md --vllm-plots=results/plots -p no:cacheprovider)
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
  args+=(--vllm-model-override=tiny)
fi
exec .venv/bin/python -m pytest "${args[@]}" "$@"
