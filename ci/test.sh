#!/usr/bin/env bash
# The plugin's own tests: unit tests and end-to-end tests against real vLLM servers (CPU here).
# Sets up .venv first (idempotent). Extra arguments go to pytest, e.g. `bash ci/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup-venv.sh
exec .venv/bin/python -m pytest tests "$@"
