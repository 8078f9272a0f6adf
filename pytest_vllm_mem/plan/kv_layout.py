"""How vLLM's KV cache manager lays the pool out and what one request takes from it (vllm v1/core/kv_cache_utils.py).

Every attention layer's block (block_size tokens of K and V) has the same page size. Layers are grouped by kind
(full, sliding window, chunked local attention); each kind is split into groups of `group_size` layers, padded where
a kind does not divide evenly (`_get_kv_cache_groups_uniform_page_size`): the group size is the smallest kind's layer
count, or the largest's when it is less than 1.5 times the smallest. The pool is `group_size` tensors of
num_blocks pages, one layer of every group sharing each tensor, so

    num_blocks = KV bytes // (page bytes x group_size)

and one request of max_model_len takes, from that shared pool, per group: ceil(max_model_len / block) blocks for
full attention, ceil(min(window - 1 + in-flight tokens, max_model_len) / block) + 1 for a sliding window,
ceil(min(chunk + in-flight tokens, max_model_len) / block) for chunked attention. Max concurrency is num_blocks over
the sum, and "GPU KV cache size: N tokens" is concurrency x max_model_len: a derived figure (vllm#51041), so the
plan gates on KV bytes and blocks. With --disable-hybrid-kv-cache-manager every layer is planned as full attention.
The in-flight tokens are max_num_batched_tokens times vLLM's concurrent batches (two with async scheduling from
0.27, memory_plan.concurrent_batches; one before).

State layers (Gated DeltaNet, Mamba; layers.py) are grouped the same way: their page is padded to the
attention page, and one request takes a fixed number of pages per state group (`state_blocks`: 1, or 2 with prefix
caching), whatever its length.

Layers of different page sizes (Gemma 4: its full-attention layers have their own head size and KV head count)
get one page size as `unify_kv_cache_spec_page_size` gives it (v1/core/kv_cache_utils.py, 0.32): a kind whose
page divides the largest has its block raised by the ratio (more tokens per block), any other is padded to it.
KV-shared layers (Gemma 3n / Gemma 4) keep no cache and are not passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pytest_vllm_mem.plan.layers import CHUNKED, FULL, SLIDING, STATE_KINDS


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    page_bytes: int  # one block of one layer on one GPU
    group_size: int
    blocks_per_request: int  # pool blocks one max_model_len request takes, summed over the groups
    groups: tuple[tuple[str, int], ...]  # (kind, number of groups of that kind)
    bytes_per_token: int  # K/V bytes one token takes in the full-attention layers of this GPU (for display)
    full_blocks: int  # blocks one request takes in one full-attention group
    block: int  # tokens per block of the full-attention layers (raised where their page was the smaller)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0][0] != FULL

    def blocks(self, kv_bytes: int) -> int:
        return max(0, kv_bytes) // (self.page_bytes * self.group_size)

    def concurrency(self, kv_bytes: int) -> float:
        return self.blocks(kv_bytes) / self.blocks_per_request

    def tokens(self, kv_bytes: int, max_model_len: int, per_group_count: bool = False) -> int:
        """vLLM's "GPU KV cache size" line: concurrency x max_model_len (0.32), or, for a hybrid layout in earlier
        releases (0.19 checked against its logs), num_blocks // number of groups x block size."""
        if per_group_count and self.hybrid:
            groups = sum(n for _, n in self.groups)
            return self.blocks(kv_bytes) // groups * self.block
        return int(self.concurrency(kv_bytes) * max_model_len)

    def one_request_bytes(self) -> int:
        return self.blocks_per_request * self.page_bytes * self.group_size

    def longest_context(self, kv_bytes: int) -> int:
        """The longest max_model_len one request of which fits (full-attention groups bound it)."""
        block = self.block
        blocks = self.blocks(kv_bytes)
        if blocks <= 0:
            return 0
        full_groups = sum(n for kind, n in self.groups if kind == FULL)
        fixed = self.blocks_per_request - full_groups * self.full_blocks  # window/chunk groups: bounded per request
        if full_groups == 0:
            return 0 if blocks < self.blocks_per_request else blocks * block
        return max(0, (blocks - fixed) // full_groups) * block


def _blocks_for(
    kind: str, *, max_model_len: int, block: int, window: int, chunk: int, in_flight: int, state_blocks: int
) -> int:
    if kind in STATE_KINDS:
        return state_blocks
    if kind == SLIDING:
        return ceil_div(min(window - 1 + in_flight, max_model_len), block) + 1
    if kind == CHUNKED:
        return ceil_div(min(chunk + in_flight, max_model_len), block)
    return ceil_div(max_model_len, block)


def layout(
    kinds: tuple[str, ...],
    *,
    page_bytes: int,
    max_model_len: int,
    block: int,
    window: int | None,
    chunk: int | None,
    in_flight: int,
    hybrid_manager: bool = True,
    state_blocks: int = 1,
    page_by_kind: Mapping[str, int] | None = None,
) -> KVLayout:
    """The pool layout of one GPU's layers (`kinds`: one per layer that keeps a cache: attention or state).
    `page_by_kind`: a kind's page at `block` where it differs from `page_bytes`."""
    pages = {kind: (page_by_kind or {}).get(kind, page_bytes) for kind in set(kinds)}
    largest_page = max(pages.values())
    blocks_of = {
        kind: block * (largest_page // page if largest_page % page == 0 else 1) for kind, page in pages.items()
    }
    counts: dict[str, int] = {}
    for kind in kinds if hybrid_manager else tuple(k if k in STATE_KINDS else FULL for k in kinds):
        counts[kind] = counts.get(kind, 0) + 1
    smallest, largest = min(counts.values()), max(counts.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups = tuple((kind, ceil_div(n, group_size)) for kind, n in counts.items())
    per_group = {
        kind: _blocks_for(
            kind,
            max_model_len=max_model_len,
            block=blocks_of.get(kind, block),
            window=window or 0,
            chunk=chunk or 0,
            in_flight=in_flight,
            state_blocks=state_blocks,
        )
        for kind in counts
    }
    full_layers = counts.get(FULL, 0)
    token_bytes = pages.get(FULL, page_bytes) // block
    return KVLayout(
        page_bytes=largest_page,
        group_size=group_size,
        blocks_per_request=sum(per_group[kind] * n for kind, n in groups),
        groups=groups,
        bytes_per_token=token_bytes * (full_layers or sum(1 for k in kinds if k not in STATE_KINDS) or 1),
        full_blocks=per_group.get(FULL, 0),
        block=blocks_of.get(FULL, block),
    )


__all__ = ["KVLayout", "ceil_div", "layout"]
