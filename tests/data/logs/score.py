"""Score a diagnose module on this corpus: python tests/data/logs/score.py [path/to/diagnose.py] [-v]

Without a path it scores the working tree's pytest_vllm_mem/diagnosis/diagnose.py. To score an older version:
    git show <commit>:pytest_vllm_mem/diagnosis/diagnose.py > /tmp/old_diagnose.py
    python tests/data/logs/score.py /tmp/old_diagnose.py
A module from before phases existed is given the phase its summary names ("while profiling", ...; weights_too_large
counts as loading_weights), so the phase figure compares like with like.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
_OLD_PHASE_WORDS = (("while profiling", "profiling"), ("while allocating the KV cache", "kv_cache_allocation"),
                    ("while capturing CUDA graphs", "graph_capture"), ("while warming up", "sampler_warmup"),
                    ("right after startup", "serving"), ("while serving", "serving"))


def load(path: Path) -> ModuleType:
    """The module at `path`, loaded inside the pytest_vllm_mem package so its relative imports resolve."""
    sys.path.insert(0, str(ROOT))
    importlib.import_module("pytest_vllm_mem")
    spec = importlib.util.spec_from_file_location("pytest_vllm_mem._scored_diagnose", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def phase_of(diagnosis: Any) -> str | None:
    if hasattr(diagnosis, "phase"):
        return diagnosis.phase  # type: ignore[no-any-return]
    if diagnosis.kind == "weights_too_large":
        return "loading_weights"
    return next((phase for words, phase in _OLD_PHASE_WORDS if words in diagnosis.summary), None)


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("-")]
    module = load(Path(paths[0]) if paths else ROOT / "pytest_vllm_mem" / "diagnose.py")
    index = json.loads((HERE / "index.json").read_text(encoding="utf-8"))
    kinds = phases = phase_total = total = 0
    for name, entry in index.items():
        if entry["kind"] == "started":
            continue
        diagnosis = module.classify_failure((HERE / name).read_text(encoding="utf-8"), 1)
        total += 1
        kind_ok = diagnosis.kind == entry["kind"]
        kinds += kind_ok
        phase_ok = None
        if "phase" in entry and entry["kind"] in ("cuda_oom", "weights_too_large"):
            phase_total += 1
            phase_ok = kind_ok and phase_of(diagnosis) == entry["phase"]
            phases += phase_ok
        if "-v" in argv and (not kind_ok or phase_ok is False):
            print(f"miss {name}: expected {entry['kind']}/{entry.get('phase')}, got {diagnosis.kind}/"
                  f"{phase_of(diagnosis)}")
    print(f"kind right: {kinds}/{total} ({kinds / total:.0%}); out-of-memory kind and phase right: "
          f"{phases}/{phase_total} ({phases / max(phase_total, 1):.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
