"""Architectures of a few much-used models, from their public config.json files on the Hugging Face hub.

Used only when a model is neither a local folder nor in the local HF cache, so a preflight of a suite (the example
suite's Llama-2-7B configs) plans on a runner that never downloaded them. A local config.json always wins.
"""

from __future__ import annotations

from typing import Any

_LLAMA2_7B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
}
_LLAMA31_8B: dict[str, Any] = {
    **_LLAMA2_7B,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-chat-hf": _LLAMA2_7B,
    "meta-llama/Llama-2-7b-hf": _LLAMA2_7B,
    "TheBloke/Llama-2-7B-Chat-AWQ": {
        **_LLAMA2_7B,
        "quantization_config": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "gemm",
        },
    },
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA31_8B,
    "meta-llama/Meta-Llama-3-8B": {**_LLAMA31_8B, "max_position_embeddings": 8192},
}
