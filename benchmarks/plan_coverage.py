"""Which architectures does the plan cover? Every decoder model type transformers knows, planned from its config class.

    python benchmarks/plan_coverage.py            # one line per outcome, then every refusal's reason
    python benchmarks/plan_coverage.py --json out.json

Each causal-LM and image-text-to-text model type of the installed transformers is planned from its config class's
defaults (the sizes of the architecture's reference model) on an H100 with vLLM 0.27.1's rules. What it shows: that
no architecture ends in a traceback, how many get a plan, and the exact reason for each that does not (an
encoder-decoder model vLLM does not serve as a decoder, a state-space layer the plan does not size ...). Class
defaults are not published checkpoints: this is a coverage check, not an accuracy figure (plan_accuracy.py is that).
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback
import warnings
from pathlib import Path
from typing import Any

from pytest_vllm_mem.plan.errors import PlanError
from pytest_vllm_mem.plan.memory_plan import GIB, Card, plan
from pytest_vllm_mem.plan.modelinfo import ModelInfoError, model_info_from_config

H100 = Card("cuda", "H100 80GB", int(79.19 * GIB), nvlink=True)


def model_types() -> dict[str, str]:
    """Model type -> architecture class name, for the decoder and image-text-to-text models transformers maps."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    found: dict[str, str] = {}
    for mapping in (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        for model_type, names in mapping.items():
            listed: Any = names  # a class name, or a tuple of them in some transformers releases
            found[model_type] = str(listed[0] if isinstance(listed, tuple) else listed)
    return found


def outcome(model_type: str, architecture: str) -> tuple[str, str]:
    """(verdict or why there is none, the reason's text)."""
    from transformers import CONFIG_MAPPING

    try:
        config: dict[str, Any] = CONFIG_MAPPING[model_type]().to_dict()
    except Exception as error:  # a config class that needs arguments: not the plan's doing
        return "no default config", f"{type(error).__name__}: {error}"[:200]
    config["architectures"] = [architecture]
    try:
        info = model_info_from_config(config, name=model_type)
        return plan(info, {}, H100, vllm_version="0.27.1", default_utilization=0.9).verdict, ""
    except PlanError as error:
        return type(error).__name__, str(error)
    except ModelInfoError as error:
        return "ModelInfoError", str(error)
    except Exception:
        return "traceback", traceback.format_exc(limit=3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    rows = {t: outcome(t, arch) for t, arch in sorted(model_types().items())}
    counts = collections.Counter(result for result, _ in rows.values())
    planned = sum(n for result, n in counts.items() if result in ("fits", "kv_cache_insufficient", "weights_too_large"))
    print(f"{len(rows)} model types: {planned} planned; " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    for model_type, (result, reason) in rows.items():
        if reason:
            print(f"  {model_type}: {result}: {reason.splitlines()[0][:300]}")
    if args.json:
        args.json.write_text(json.dumps({t: {"outcome": r, "reason": why} for t, (r, why) in rows.items()}, indent=1))
    return 1 if counts.get("traceback") else 0


if __name__ == "__main__":
    raise SystemExit(main())
