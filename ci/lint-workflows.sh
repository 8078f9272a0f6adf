#!/usr/bin/env bash
# The GitHub Actions templates users copy (ci/github-*.yml), checked with zizmor: pinned actions, no persisted
# credentials, minimal permissions, no template injection. zizmor lives in its own virtual environment under the
# user cache (kept between runs; a version bump here reinstalls it), not in .venv: the plugin does not need it.
#   bash ci/lint-workflows.sh                 # the templates
#   bash ci/lint-workflows.sh some/workflow.yml  # other files instead
set -euo pipefail
cd "$(dirname "$0")/.."
version="1.32.0"
venv="${ZIZMOR_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pytest-vllm-mem/zizmor-venv}"
python="${PYTHON:-python3}"
if [ "$(cat "$venv/.zizmor-version" 2>/dev/null)" != "$version" ] || ! "$venv/bin/zizmor" --version >/dev/null 2>&1; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # This machine's pip config lists local mirror folders that exist only for some packages: drop that warning.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "zizmor==$version" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
  echo "$version" > "$venv/.zizmor-version"
fi
# --offline: no GitHub API calls (CI here has no network to it); pedantic: the strictest persona short of auditor,
# which would only add that the GPU template runs on a self-hosted runner, as it must.
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(ci/github-*.yml)
exec "$venv/bin/zizmor" --offline --persona=pedantic "${files[@]}"
