"""A config.json completed with the transformers config class defaults it relies on, as vLLM reads it.

Many published configs name only what differs from their class's defaults (gemma-3-4b-it's text_config has no
num_attention_heads; llava-v1.6-mistral's text_config names almost nothing). vLLM reads config.json through
transformers' `AutoConfig`, so a field left out takes the class default; the plan does the same here, offline:
`AutoConfig.for_model(model_type, **config)` builds the class from the dictionary alone (no hub access) and
`to_dict()` returns every field. transformers comes with vLLM; without it, or for a model type it does not know,
the config is returned unchanged. Only called when a field the plan needs is missing: importing transformers costs
seconds of CPU, more than a whole preflight of a suite whose configs are complete.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def with_class_defaults(config: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(the config with its class defaults filled in, None) or (the config unchanged, why not)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return config, "config.json names no model_type"
    if not transformers_available():
        return config, "transformers is not installed"
    try:
        from transformers import AutoConfig

        fields = {k: v for k, v in copy.deepcopy(config).items() if k != "model_type"}
        built = AutoConfig.for_model(model_type, **fields)
        full = built.to_dict()
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return config, f"transformers could not build a {model_type} config ({error})"
    for key, value in config.items():  # keep what config.json says where the class renamed or dropped it
        full.setdefault(key, value)
    return full, None


__all__ = ["transformers_available", "with_class_defaults"]
