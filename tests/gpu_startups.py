"""The public GPU startups the plan is checked against (benchmarks/data/gpu_startups.json): their model configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pytest_vllm_mem.plan.modelinfo import ModelInfo, model_info_from_config

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "gpu_startups.json"
MODELS: dict[str, Any] = json.loads(DATA.read_text())["models"]


def model(name: str) -> ModelInfo:
    """The model of that name in the data file, read from its recorded config.json."""
    return model_info_from_config(MODELS[name]["config"], name=name)
