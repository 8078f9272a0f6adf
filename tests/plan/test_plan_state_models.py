"""State-space models: Granite 4.0 H's and Nemotron-H's Mamba2 layers planned; other families refused by name.

Expected parameter counts come from transformers 5.19's own GraniteMoeHybridForCausalLM / NemotronHForCausalLM built
on the meta device
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


# A Nemotron-H config in the layout of NVIDIA's published ones (hybrid_override_pattern: M a Mamba2 mixer,
# - an MLP, * attention, E experts), 8 layers; transformers 5.19 counts 129,158,432 parameters for it, and vLLM's
# router adds an e_score_correction_bias per expert (8) that transformers' model does not hold.
NEMOTRON_H: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 8,
    "hybrid_override_pattern": "M-M*-M-E",
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 32,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 512,
    "moe_shared_expert_intermediate_size": 1024,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# the same pattern as transformers >= 5 saves it (no num_hidden_layers, no pattern string)
NEMOTRON_H_NEW = {k: v for k, v in NEMOTRON_H.items() if k not in ("num_hidden_layers", "hybrid_override_pattern")}
NEMOTRON_H_NEW["layers_block_type"] = ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp"]
NEMOTRON_H_NEW["layers_block_type"] += ["linear_attention", "mlp", "moe"]


@pytest.mark.parametrize("config", [NEMOTRON_H, NEMOTRON_H_NEW])
def test_nemotron_h_blocks_are_counted_and_its_mamba2_state_planned(config: dict[str, Any]) -> None:
    info = model_info_from_config(config, name="nemotron-h")
    assert architecture_weight_bytes(info, 2) / 2 == 129_158_432 + 8
    predicted = plan(info, {"max_model_len": 8192}, H100, vllm_version="0.27.1")
    # conv 3 x (32 x 64 + 2 x 8 x 128) bf16 and temporal 32 x 64 x 128 in float32 (vLLM's NemotronH config class
    # turns "auto" into float32): 24,576 + 1,048,576 bytes
    assert any("1,073,152 B of state per layer and request" in note for note in predicted.notes), predicted.notes
    assert predicted.verdict == "fits"


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (
            {k: v for k, v in NEMOTRON_H.items() if not k.startswith(("mamba_", "ssm_"))},
            "a Nemotron-H block pattern without the mamba_num_heads",
        ),
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
