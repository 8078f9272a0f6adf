"""The LoRA slot buffers vLLM allocates beside the weights under --enable-lora (vllm 0.32 lora/layers).

Every LoRA-wrapped linear layer holds, for each of `max_loras` slots (LoRAConfig: default 1) and each of its slices
(q, k, v for the merged QKV projection; gate and up for the merged MLP input), an A stack of max_lora_rank x its
input width and a B stack of its output width x max_lora_rank (`BaseLinearLayerWithLoRA.create_lora_weights`), in
--lora-dtype (default: the model's dtype). With tensor parallelism a column-parallel layer keeps its full input and
its share of the output, a row-parallel one its share of the input and its full output. Counted here: attention
(q, k, v, o) and a dense MLP (gate, up, down) in every layer, and the vocabulary-wide stacks (lora_vocab_bytes):
models that name `embedding_modules` (Llama, Qwen2/3 ...) get their input embedding wrapped
(`VocabParallelEmbeddingWithLoRA`: A of slots x vocabulary x rank, B of slots x hidden x rank, the whole vocabulary
on every rank) and their logits processor (`LogitsProcessorWithLoRA`: A of slots x rank x hidden, B of slots x
vocabulary x rank); with tied embeddings the LM head is the embedding module under a second name, which
`LoRAModelManager._create_lora_modules` wraps again (the "lm_head" exception to its alias rule), one more embedding
stack (read in vLLM 0.27.1, 0.32.0 and 0.33.0). Not counted: LoRA on MoE experts and state layers, and the punica
kernels' per-batch buffers. On a public RTX 4090 startup of Qwen3-4B with 64 slots (benchmarks/data/gpu_startups.json:
12.49 GiB loaded) the layers' slots leave 1.06 GiB unexplained and the vocabulary stacks 0.88 of it.
"""

from __future__ import annotations

from pytest_vllm_mem.plan.model_runner import architectures
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


# The text architectures whose vLLM class (or a base class) names `embedding_modules` (vLLM 0.32.0's registry and
# model files, read with ast): only these get the vocabulary-wide stacks. Qwen2, Gemma and gpt-oss do not.
VOCAB_LORA_ARCHITECTURES = frozenset(
    {
        "ApertusForCausalLM",
        "Cohere2ForCausalLM",
        "CohereForCausalLM",
        "DeciLMForCausalLM",
        "Ernie4_5ForCausalLM",
        "Exaone4ForCausalLM",
        "ExaoneForCausalLM",
        "ExaoneMoEForCausalLM",
        "ExaoneMoeForCausalLM",
        "FalconH1ForCausalLM",
        "GraniteForCausalLM",
        "GraniteMoeForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeSWAForCausalLM",
        "GraniteMoeSharedForCausalLM",
        "GraniteSWAForCausalLM",
        "HyperCLOVAXForCausalLM",
        "IQuestCoderForCausalLM",
        "InternLM3ForCausalLM",
        "JambaForCausalLM",
        "K2HorizonForCausalLM",
        "LLaMAForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "Llama4ForCausalLM",
        "LlamaForCausalLM",
        "MiniCPM3ForCausalLM",
        "MiniCPMForCausalLM",
        "MixtralForCausalLM",
        "NemotronForCausalLM",
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
        "Param2MoEForCausalLM",
        "Phi3ForCausalLM",
        "PhiMoEForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "SolarForCausalLM",
        "TeleChat2ForCausalLM",
        "TeleChat3ForCausalLM",
        "TeleFLMForCausalLM",
    }
)


def lora_vocab_bytes(info: ModelInfo, *, slots: int, rank: int, dtype: float) -> tuple[int, int]:
    """(first stage, last stage) bytes of the vocabulary-wide LoRA stacks: the embedding's on the first pipeline
    stage; the logits processor's, and a tied LM head's second embedding stack, on the last. (0, 0) for an
    architecture outside VOCAB_LORA_ARCHITECTURES."""
    if not VOCAB_LORA_ARCHITECTURES.intersection(architectures(info.raw)):
        return 0, 0
    embedding = slots * rank * (info.vocab_size + info.hidden_size)
    last = embedding * (2 if info.tie_word_embeddings else 1)  # logits processor: the same two shapes, transposed
    return int(embedding * dtype), int(last * dtype)


__all__ = ["DEFAULT_MAX_LORAS", "DEFAULT_MAX_LORA_RANK", "VOCAB_LORA_ARCHITECTURES", "lora_bytes", "lora_vocab_bytes"]
