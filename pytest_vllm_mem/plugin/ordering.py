"""Test order: tests that need the same server run one after another, so each config starts once.

The pool keeps one server at a time (one device), so a config that comes back after another config was started
costs a second startup (30-60 s on CPU, minutes for a large model on a GPU). Grouping happens at collection: each
group takes the place of its first test, members keep their relative order, and tests that start no server of a
known config (no vllm_server, or vllm_start with a config chosen in the test body) stay where they were.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, TypeVar

__all__ = ["DEFAULT_CONFIG", "group_by_server_config", "server_config_key"]

# The key of tests that use the session's default config (vllm_server without a parametrized vllm_config).
DEFAULT_CONFIG = "<default vllm_config>"
# Fixtures that start a server for the test's vllm_config.
_SERVER_FIXTURES = ("vllm_server", "vllm_load")


class _Item(Protocol):
    @property
    def fixturenames(self) -> Sequence[str]: ...


def server_config_key(item: _Item) -> Hashable | None:
    """What server `item` needs before its body runs, as far as collection can tell; None when unknown."""
    if not any(name in item.fixturenames for name in _SERVER_FIXTURES):
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "vllm_config" not in params:
        return DEFAULT_CONFIG
    config: Hashable = params["vllm_config"]
    try:
        hash(config)
    except TypeError:  # an unhashable indirect param (e.g. a dict the user's fixture turns into a config)
        return repr(config)
    return config


T = TypeVar("T", bound=_Item)


def group_by_server_config(items: Sequence[T]) -> list[T]:
    """`items` with the tests of each server config moved up behind the first test that needs it."""
    keys = [server_config_key(item) for item in items]
    members: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        if key is not None:
            members.setdefault(key, []).append(index)
    ordered: list[T] = []
    placed: set[Hashable] = set()
    for item, key in zip(items, keys):
        if key is None:
            ordered.append(item)
        elif key not in placed:
            placed.add(key)
            ordered.extend(items[index] for index in members[key])
    return ordered
