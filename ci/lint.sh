#!/usr/bin/env bash
# Lint, format check, strict type check (package, tests, benchmarks) and import contracts, with the .venv's tools (the `lint` extra:
# pip install -e '.[lint]'). Settings live in pyproject.toml ([tool.ruff], [tool.mypy]). Runs every check, then
# exits non-zero if any failed, so one run shows every problem. Fix formatting with `ruff format`.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
failed=0
run() {
    echo "+ $*"
    "$@" || failed=1
}
run "$PYTHON" -m ruff check .
run "$PYTHON" -m ruff format --check .
# One strict run over pytest_vllm_mem, tests and benchmarks ([tool.mypy] files): one pass over the shared imports, and
# .mypy_cache makes a rerun check only what changed.
run "$PYTHON" -m mypy
run "$(dirname "$PYTHON")/lint-imports"  # the package's import rules ([tool.importlinter] contracts)
exit "$failed"
