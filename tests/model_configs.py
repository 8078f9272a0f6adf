"""Model configs several plan tests read."""

from __future__ import annotations

from typing import Any

from pytest_vllm_mem.plan.known_models import KNOWN_CONFIGS

# The package's tiny model (pytest_vllm_mem/tiny_model.py) as the plan reads it: 1,024 bytes of KV per token.
TINY_CONFIG: dict[str, Any] = {
    **KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 3072,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
