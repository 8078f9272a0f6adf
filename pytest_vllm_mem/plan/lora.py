"""The LoRA slot buffers vLLM allocates beside the weights under --enable-lora (vllm 0.32 lora/layers).

Every LoRA-wrapped linear layer holds, for each of `max_loras` slots (LoRAConfig: default 1) and each of its slices
(q, k, v for the merged QKV projection; gate and up for the merged MLP input), an A stack of max_lora_rank x its
input width and a B stack of its output width x max_lora_rank (`BaseLinearLayerWithLoRA.create_lora_weights`), in
--lora-dtype (default: the model's dtype). With tensor parallelism a column-parallel layer keeps its full input and
its share of the output, a row-parallel one its share of the input and its full output. Counted here: attention
(q, k, v, o) and a dense MLP (gate, up, down) in every layer. Not counted: LoRA on the embedding and LM head, on MoE
experts and state layers, and the punica kernels' per-batch buffers; on a public RTX 4090 startup of Qwen3-4B with
64 slots this leaves 0.9 of the 4.86 GiB the slots added (benchmarks/data/gpu_startups.json).
"""

from __future__ import annotations

from pytest_vllm_mem.plan.modelinfo import ModelInfo

DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


def lora_bytes(info: ModelInfo, *, slots: int, rank: int, tp: int, dtype: float) -> int:
    """Bytes of the LoRA slot buffers on one GPU: `slots` (--max-loras) of rank `rank` (--max-lora-rank)."""
    h, tp = info.hidden_size, max(1, tp)
    q_out, kv_out = info.num_attention_heads * info.head_dim, info.num_kv_heads * info.head_dim
    # (slices x full input + output share) for column-parallel layers, (input share + full output) for row-parallel
    qkv = 3 * h + (q_out + 2 * kv_out) // tp
    out = q_out // tp + h
    per_layer = qkv + out
    if not info.num_experts:
        inter = info.intermediate_size
        per_layer += 2 * h + 2 * inter // tp + inter // tp + h
    return int(slots * rank * per_layer * info.num_layers * dtype)


__all__ = ["DEFAULT_MAX_LORAS", "DEFAULT_MAX_LORA_RANK", "lora_bytes"]
