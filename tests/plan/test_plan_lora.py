"""--enable-lora's slot buffers (plan/lora.py), sized as vLLM 0.32's BaseLinearLayerWithLoRA.create_lora_weights
allocates them, checked against a public RTX 4090 startup of Qwen3-4B with 64 slots."""

from __future__ import annotations

import pytest

from pytest_vllm_mem.plan.lora import lora_bytes, lora_vocab_bytes
from pytest_vllm_mem.plan.memory_plan import GIB, Card, plan
from pytest_vllm_mem.plan.modelinfo import model_info_from_config

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
RTX4090 = Card("cuda", "NVIDIA GeForce RTX 4090", int(23.52 * GIB), nvlink=False)


def test_slots_are_rank_by_input_and_output_of_every_wrapped_linear() -> None:
    info = model_info_from_config(QWEN3_4B, name="Qwen/Qwen3-4B")
    # Per layer and rank: QKV 3 x 2560 in + 6144 out, o 4096 + 2560, gate/up 2 x 2560 + 2 x 9728, down 9728 + 2560.
    per_layer = 3 * 2560 + 6144 + 4096 + 2560 + 2 * 2560 + 2 * 9728 + 9728 + 2560
    slots = {"slots": 64, "rank": 16}
    assert lora_bytes(info, **slots, tp=1, dtype=2) == 64 * 16 * per_layer * 36 * 2
    assert lora_bytes(info, slots=64, rank=32, tp=1, dtype=2) == 2 * lora_bytes(info, **slots, tp=1, dtype=2)
    assert lora_bytes(info, **slots, tp=2, dtype=2) < lora_bytes(info, **slots, tp=1, dtype=2)
    # Without --enable-lora the plan counts none.
    rtx4090 = Card("cuda", "NVIDIA GeForce RTX 4090", int(23.52 * GIB), nvlink=False)
    assert plan(info, {"max_loras": 64}, rtx4090).weights == plan(info, {}, rtx4090).weights


def test_64_slots_on_an_rtx_4090_are_counted_in_what_the_startup_logged_as_consumed() -> None:
    # alexostapiuk11/coldstart-recon-worker (benchmarks/data/gpu_startups.json, fourteenth collection), vLLM 0.27.1:
    # 'Actual usage is 12.78 GiB for consumed memory (weights + non-torch), 0.15 GiB for peak activation, and 1.28 GiB
    # for CUDAGraph memory', 'Available KV cache memory: 5.89 GiB' at utilization 0.8: 18.82 - 12.78 - 0.15 = 5.89,
    # the graphs not taken out (Model Runner V2, plan/model_runner.py). Without the slots the plan's consumed memory
    # was 7.8 GiB; with the layers' slots 11.73; with the embedding, logits and tied LM-head stacks 12.61.
    info = model_info_from_config(QWEN3_4B, name="Qwen/Qwen3-4B")
    flags = {"gpu_memory_utilization": 0.8, "enable_lora": True, "max_loras": 64}
    planned = plan(info, flags, RTX4090, vllm_version="0.27.1")
    consumed = (planned.weights.value + planned.non_torch.value) / GIB
    assert consumed == pytest.approx(12.78, rel=0.02)
    assert not planned.graph_in_budget
    left = planned.requested_bytes - planned.weights.value - planned.non_torch.value - planned.activation.value
    assert planned.kv_bytes.value == left
    assert planned.kv_bytes.value / GIB == pytest.approx(5.89, rel=0.05)
    assert any("4.82 GiB of LoRA slots" in note for note in planned.notes)  # says what it counted and what not


def test_the_vocabulary_stacks_follow_the_architectures_vllm_wraps() -> None:
    # VocabParallelEmbeddingWithLoRA (A: slots x vocabulary x rank, B: slots x hidden x rank) and
    # LogitsProcessorWithLoRA (the same shapes transposed); a tied LM head is wrapped again under its own name.
    info = model_info_from_config(QWEN3_4B, name="Qwen/Qwen3-4B")
    stack = 64 * 16 * (151936 + 2560) * 2
    assert lora_vocab_bytes(info, slots=64, rank=16, dtype=2) == (stack, 2 * stack)
    untied = model_info_from_config({**QWEN3_4B, "tie_word_embeddings": False}, name="untied")
    assert lora_vocab_bytes(untied, slots=64, rank=16, dtype=2) == (stack, stack)
    qwen2 = model_info_from_config(
        {**QWEN3_4B, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, name="q2"
    )
    assert lora_vocab_bytes(qwen2, slots=64, rank=16, dtype=2) == (0, 0)  # Qwen2's class names no embedding_modules


def test_a_yarn_context_is_scaled_from_its_original_length_before_vllm_0_30() -> None:
    # vLLM 0.27.1-0.29.0 config/model.py: a yarn RoPE derives original_max_position_embeddings x factor; 0.30.0 on
    # counts yarn as already scaled. A public 4x H100 startup of Qwen3-32B (vLLM 0.10.0, yarn factor 4 over 32768)
    # served max_model_len 131072 (benchmarks/data/gpu_startups.json, fifteenth collection).
    from pytest_vllm_mem.plan.errors import PlanRefused

    config = {
        **QWEN3_4B,
        "max_position_embeddings": 40960,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    info = model_info_from_config(config, name="Qwen/Qwen3-32B")
    assert (info.derived_max_len, info.derived_max_len_before_0_30) == (40960, 131072)
    h100 = Card("cuda", "H100", int(79.19 * GIB))
    assert plan(info, {"max_model_len": 131072}, h100, vllm_version="0.29.0").verdict in (
        "fits",
        "kv_cache_insufficient",
    )
    with pytest.raises(PlanRefused, match="derived max_model_len"):
        plan(info, {"max_model_len": 131072}, h100, vllm_version="0.30.0")
