"""State-space models: Granite 4.0 H's Mamba2 layers planned; every other state-space family refused by name.

Expected parameter counts come from transformers 5.19's own GraniteMoeHybridForCausalLM built on the meta device
(no weights) for the configs below, the sum of `numel()` over `model.parameters()`:

    with torch.device("meta"): model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**GRANITE_H))

The state page follows vLLM 0.27.1's MambaStateShapeCalculator.mamba2_state_shape (conv state (d_conv - 1) x
(expand x hidden + 2 groups x d_state), temporal state heads x d_head x d_state, both in the model dtype for
Granite), and granitemoehybrid.py's get_mamba_state_shape_from_config, which feeds it those config fields.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from pytest_vllm_mem.plan.errors import PlanUnsupported
from pytest_vllm_mem.plan.layers import FULL, MAMBA2
from pytest_vllm_mem.plan.memory_plan import GIB, Card, plan
from pytest_vllm_mem.plan.modelinfo import model_info_from_config
from pytest_vllm_mem.plan.weights import architecture_weight_bytes

# The layout of a published Granite 4.0 H config.json (ibm-granite's tiny test model's fields), 8 layers.
GRANITE_H: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "layer_types": ["mamba", "mamba", "mamba", "attention"] * 2,
    "mamba_d_conv": 4,
    "mamba_d_head": 128,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 8,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "shared_intermediate_size": 512,
    "max_position_embeddings": 4096,
    "position_embedding_type": "nope",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 49152,
}
H100 = Card("cuda", "H100", int(79.19 * GIB), nvlink=True)


@pytest.mark.parametrize(
    ("config", "transformers_count"),
    [
        (GRANITE_H, 144_552_080),
        # without experts the shared MLP is the layer's MLP (granitemoehybrid.py builds no block_sparse_moe)
        ({**GRANITE_H, "num_local_experts": 0, "shared_intermediate_size": 2048}, 62_730_384),
        # layer types as transformers >= 5.13 saves them
        (
            {
                **GRANITE_H,
                "layer_types": ["linear_attention"] * 3
                + ["full_attention"]
                + ["linear_attention"] * 3
                + ["full_attention"],
            },
            144_552_080,
        ),
    ],
)
def test_granite_h_weights_are_counted_as_transformers_builds_them(
    config: dict[str, Any], transformers_count: int
) -> None:
    info = model_info_from_config(config, name="granite-h")
    assert info.kinds == (MAMBA2, MAMBA2, MAMBA2, FULL) * 2
    assert architecture_weight_bytes(info, 2) / 2 == pytest.approx(transformers_count, rel=1e-6)


def test_granite_h_state_page_is_vllms_mamba2_shape_and_the_config_is_planned() -> None:
    info = model_info_from_config(GRANITE_H, name="granite-h")
    predicted = plan(info, {"max_model_len": 4096}, H100, vllm_version="0.27.1", default_utilization=0.9)
    # conv (4 - 1) x (2 x 512 + 2 x 1 x 128) and temporal 8 x 128 x 128, bf16: 7,680 + 262,144 bytes
    assert any("269,824 B of state per layer and request" in note for note in predicted.notes), predicted.notes
    assert predicted.verdict == "fits"
    # under TP 2 the heads and the conv channels split, the single group repeated on each GPU
    # (extra_groups_for_head_shards): conv 3 x (1,024 + 2 x 2 x 128) / 2 and temporal 4 x 128 x 128, bf16
    tp2 = plan(info, {"max_model_len": 4096, "tensor_parallel_size": 2}, H100, vllm_version="0.27.1")
    assert any("135,680 B of state" in note for note in tp2.notes), tp2.notes


NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 4480,
    "intermediate_size": 15680,
    "num_hidden_layers": 8,
    "hybrid_override_pattern": "M-M*-M-E",
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "mamba_num_heads": 128,
    "mamba_head_dim": 80,
    "ssm_state_size": 128,
    "n_groups": 8,
    "vocab_size": 131072,
}


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (NEMOTRON_H, "Nemotron-H's layers hold one block each"),
        (
            {**GRANITE_H, "model_type": "jamba", "layer_types": None, "attn_layer_period": 4, "attn_layer_offset": 3},
            "Mamba (v1) mixers",
        ),
        ({**GRANITE_H, "model_type": "falcon_h1", "layer_types": None}, "Falcon-H1 runs attention and a Mamba2 mixer"),
        ({"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24, "state_size": 16}, "attention-free"),
        ({"model_type": "mamba2", "hidden_size": 4096, "num_hidden_layers": 64, "num_heads": 128}, "Mamba2 state"),
        (
            {
                **GRANITE_H,
                "model_type": "kimi_linear",
                "layer_types": None,
                "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7]},
            },
            "Kimi Delta Attention",
        ),
        (
            {**GRANITE_H, "model_type": "minimax", "layer_types": None, "attn_type_list": [0, 0, 0, 1] * 2},
            "lightning attention",
        ),
        (
            {
                "model_type": "dbrx",
                "d_model": 6144,
                "n_heads": 48,
                "n_layers": 40,
                "ffn_config": {"moe_num_experts": 16},
            },
            "DBRX",
        ),
    ],
)
def test_other_state_space_and_nested_layouts_are_refused_by_name_never_planned_as_attention(
    config: dict[str, Any], named: str
) -> None:
    with pytest.raises(PlanUnsupported, match=re.escape(named)):
        info = model_info_from_config(config, name="m")
        plan(info, {}, H100, vllm_version="0.27.1")


def test_mpt_keys_are_read() -> None:
    info = model_info_from_config({"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32}, name="mpt")
    assert (info.num_layers, info.hidden_size, info.num_attention_heads, info.intermediate_size) == (
        32,
        4096,
        32,
        16384,
    )
