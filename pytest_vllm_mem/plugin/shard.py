"""`--vllm-shard=K/N`: run the K-th of N deterministic parts of a suite, for N CI runners.

Every test of one server config lands in the same shard, so each shard starts each of its configs once, as an
unsharded run does. The split depends only on the set of tests, never on their order: each group (a config's tests,
or one test that starts no known config) has an identity (the config's command line with its flags sorted, or the
test's node id) and a cost (a server startup plus its tests); the groups, costliest first and ties broken by a hash
of the identity, go one by one to the shard with the least cost so far (longest-processing-time greedy, within 4/3
of the best possible balance). So every runner computes the same split from the same suite, whatever order its
collection found the tests in, and the shards together run each selected test exactly once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.plugin.ordering import server_config_key
from pytest_vllm_mem.settings import UsageError

__all__ = ["STARTUP_COST", "Shard", "assign_groups", "group_identity", "parse_shard", "split_items"]

# What a server startup costs, in tests: 30-60 s on the CPU, 1-3 min on a GPU, against a few seconds to a minute for
# one test's load. A guess that only shapes the balance, never which tests run.
STARTUP_COST = 3


class _Item(Protocol):
    @property
    def nodeid(self) -> str: ...


T = TypeVar("T", bound=_Item)

_SHARD = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True)
class Shard:
    """The `index`-th (1-based) of `count` shards."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str | None, source: str = "--vllm-shard") -> Shard | None:
    """`"2/4"` -> Shard(2, 4); None or "" -> None (no sharding). Anything else is a UsageError naming the input."""
    if text is None or not str(text).strip():
        return None
    match = _SHARD.fullmatch(str(text))
    if match is not None:
        index, count = int(match.group(1)), int(match.group(2))
        if 1 <= index <= count:
            return Shard(index, count)
    raise UsageError(
        f"{source}={text!r}: expected K/N, the K-th of N shards with 1 <= K <= N (e.g. --vllm-shard=1/2 and "
        "--vllm-shard=2/2 on two CI runners split the suite between them; the tests of one vllm_config stay in one "
        "shard)."
    )


def _config_identity(config: VLLMConfig) -> str:
    """The command a config runs, in a form equal configs share however their flags were written (order, 4096 or
    "4096": VLLMConfig's own equality)."""
    return json.dumps([sorted(config.env.items()), config.model, sorted(config.flag_args())])


def group_identity(key: Hashable, node_ids: Sequence[str]) -> str:
    """A name for the tests of one server config that is the same on every machine: the config's command line, or
    (a config whose repr shows an object address, which differs between processes) its smallest member node id."""
    if isinstance(key, VLLMConfig):
        return "config:" + _config_identity(key)
    text = key if isinstance(key, str) else repr(key)
    if " at 0x" in text:
        return "test:" + min(node_ids)
    return "config:" + text


def assign_groups(costs: Mapping[str, float], count: int) -> dict[str, int]:
    """Each group (identity -> cost) to a shard, 1..count, greedily: costliest first (ties by a hash of the
    identity, so neighbours in a parametrization spread out), each to the least loaded shard (ties: the lowest)."""

    def order(identity: str) -> tuple[float, str, str]:
        return -costs[identity], hashlib.sha256(identity.encode()).hexdigest(), identity

    loads = [0.0] * count
    assigned: dict[str, int] = {}
    for identity in sorted(costs, key=order):
        shard = min(range(count), key=lambda index: (loads[index], index))
        loads[shard] += costs[identity]
        assigned[identity] = shard + 1
    return assigned


def split_items(items: Sequence[T], shard: Shard) -> tuple[list[T], list[T]]:
    """(selected, deselected): the tests of shard `shard` and the others, each in their order in `items`."""
    identity_of: list[str] = []
    by_config: dict[Hashable, list[int]] = {}
    costs: dict[str, float] = {}
    for index, item in enumerate(items):
        # Collected test functions have fixturenames; other items (a doctest, a plugin's own) start no server.
        key = server_config_key(item) if hasattr(item, "fixturenames") else None  # type: ignore[arg-type]
        if key is None:  # starts no server known at collection: a group of its own
            identity = "test:" + str(item.nodeid)
            costs[identity] = 1.0
        else:
            by_config.setdefault(key, []).append(index)
            identity = ""  # set below, once the config's members are known
        identity_of.append(identity)
    for key, members in by_config.items():
        identity = group_identity(key, [str(items[index].nodeid) for index in members])
        # Two configs share an identity only when their reprs do: their costs add and they share a shard.
        costs[identity] = costs.get(identity, 0.0) + STARTUP_COST + len(members)
        for index in members:
            identity_of[index] = identity
    assigned = assign_groups(costs, shard.count)
    selected: list[T] = []
    deselected: list[T] = []
    for item, identity in zip(items, identity_of):
        (selected if assigned[identity] == shard.index else deselected).append(item)
    return selected, deselected
